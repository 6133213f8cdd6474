# cython: language_level=3
# distutils: language = c++
"""Python's handle on the worker's native data plane (core/pipeline/bps_worker.h).

core/engine_setup.py creates one :class:`WorkerCore` per job after the servers are authenticated,
hands it a direct link to each (TCP or UCX: partitions never go through ZeroMQ), and from then on:

* :meth:`submit` gives it a whole push_pull or broadcast (one call per tensor, on the caller's
  thread); the native thread "byteps-net" sends, receives and copies every partition without the GIL;
* :meth:`wait` (no GIL while waiting) returns the ops that completed, for the engine's completion
  thread, which sets their events;
* :meth:`send` queues Python's own messages (compression, topology ranges, join()'s local reduce) on
  the same links, and :meth:`forwarded` returns the replies the native side does not own;
* on a machine with several processes, :meth:`add_local` hands it the local ROUTER/DEALERs too: it
  runs the local reduce of plain push_pulls (core/local.py's protocol), and :meth:`forwarded_local`
  returns the local messages it does not own (handshakes, Python's partitions).

Nothing here is called per partition from Python.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector

include "byteps/core/native_runtime.pxi"  # available, ucx_load, trace_buffer, ...: this module's copy

cdef extern from "core/pipeline/bps_stages.h":
    const int BPS_STAGE_COUNT


cdef extern from "core/pipeline/bps_worker.h" nogil:
    const size_t BPS_RING_REGION
    const uint64_t BPS_STAGE_THREAD_MIN_BYTES
    const int64_t BPS_CREDIT_STALL_MS

    ctypedef struct BpsDescriptor:
        int32_t pid
        int32_t fd
        uint64_t inode
        uint64_t offset
        uint64_t length

    cdef cppclass BpsPart:
        uint64_t key
        uint64_t offset
        uint64_t length
        int32_t server
        unsigned char *staging
        BpsDescriptor desc
        int32_t owner
        int32_t nccl_root
        cbool colocated
        cbool compress

    cdef cppclass BpsTableCodec:
        int method
        int flags
        int levels
        double k
        uint64_t seed
        double mu
        cbool nesterov
        uint32_t stream

    cdef cppclass BpsOp:
        int64_t id
        string name
        uint8_t cmd
        uint8_t dtype
        uint32_t root
        int64_t priority
        cbool root_self
        unsigned char *buf
        uint64_t nbytes
        vector[BpsPart] parts
        int error_kind
        string error

    cdef cppclass BpsRawSend:
        string ident
        string header
        string body

    cdef cppclass BpsForward:
        int server
        vector[string] frames

    cdef struct BpsOwed:
        uint64_t key
        uint64_t rnd
        uint8_t dtype
        uint64_t length

    cdef cppclass BpsWorkerCore:
        BpsWorkerCore(uint32_t node_id, int64_t credit, double timeout, int nthreads, int notify_fd)
        int64_t add_table(const string &name, vector[BpsPart] parts, const BpsTableCodec *codec, int64_t codec_of)
        void submit_table(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                           cbool root_self, unsigned char *buf, uint64_t nbytes, cbool lazy, uint32_t divisor)
        void submit_abandon(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, cbool root_self,
                            unsigned char *buf, uint64_t nbytes, const string &reason)
        string enable_gpu(const string &cudart, uint64_t slot_bytes, int slots)
        string enable_nccl(const string &path)
        uint64_t nccl_collectives()
        void submit_gpu(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                        cbool root_self, uint64_t dev_ptr, int device, uint64_t nbytes, uint64_t ready_event,
                        uint64_t done_event, cbool lazy, uint32_t divisor)
        uint64_t gpu_peak_slots()
        uint64_t gpu_copies()
        uint64_t gpu_grown()
        cbool add_server()
        cbool add_server_live(int fd)
        vector[uint64_t] hold(const vector[int] &dead)
        void commit(const vector[int] &alive, const vector[int64_t] &tables, const vector[uint64_t] &start,
                    vector[vector[BpsPart]] segs)
        void lost_links(vector[int] *out)
        void add_segment(int64_t table, uint64_t start, vector[BpsPart] parts)
        void set_elastic(cbool on)
        void set_lone_machine(cbool on)
        void set_direct_spin(double seconds)
        void set_colocated(int server, cbool on)
        uint64_t results_sent()
        void add_link(int server, int fd)
        string add_ucx_link(int server, const string &host, int port, const string &token, const string &ident,
                            double timeout)
        string link_transport(int server)
        int links_up()
        cbool submit_direct(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                            cbool root_self, unsigned char *buf, uint64_t nbytes, uint32_t divisor)
        uint64_t direct_calls()
        uint64_t entered(int32_t code)
        uint64_t direct_adopted()
        uint64_t compressed_pushes()
        uint64_t replies_in_place()
        void add_local(void *router, int local_rank, int local_size)
        string add_local_link(int r, int fd, const string &ident, int ring_fd, cbool low)
        int local_links_up()
        int local_rings_up()
        uint64_t local_link_sent()
        uint64_t local_link_received()
        uint64_t credit_stalls(string *first)
        void set_credit(int64_t credit)
        int64_t credit()
        void set_local_joined(uint64_t mask)
        void set_join_ends(uint64_t ends)
        void set_self_joined(cbool on)
        void owed(vector[BpsOwed] *out)
        void submit_owed(int64_t id, int64_t table, uint64_t rnd, uint8_t dtype, unsigned char *buf, uint64_t nbytes)
        void forwarded_local(vector[vector[string]] *out)
        uint64_t local_reduced()
        uint64_t local_reduced_on_thread()
        uint64_t local_coordinated()
        uint64_t owed_submitted()
        uint64_t local_owner_direct()
        void start()
        void stop()
        void submit(BpsOp *op)
        void send_raw(BpsRawSend *m)
        void reset_rounds()
        void fail_all()
        cbool is_done(int64_t id)
        void prompt(int64_t id)
        uint64_t lazy_late()
        void completions(vector[int64_t] *out, int timeout_ms)
        cbool wait_op(int64_t id, int timeout_ms)
        BpsOp *op(int64_t id)
        cbool forget(int64_t id)
        void forwarded(vector[BpsForward] *out)
        uint64_t bytes_sent(int server)
        uint64_t bytes_received(int server)

#: error kinds of a completed op (core/pipeline/bps_worker.h BpsErrorKind)
OK, ERR_SERVER, ERR_PROTOCOL, ERR_TIMEOUT, ERR_ABORT, ERR_CUDA = 0, 1, 2, 3, 4, 5
RING_REGION_BYTES = BPS_RING_REGION  # a local link's shared-memory rings (core/transport/bps_link.h BpsShmLink)
#: sums and copies at least this large run on the stage thread byteps-reduce, smaller ones inline
STAGE_THREAD_MIN_BYTES = BPS_STAGE_THREAD_MIN_BYTES
#: the send queue's head goes past the credit after this long without a reply or a send
CREDIT_STALL_S = BPS_CREDIT_STALL_MS / 1000.0


cdef vector[BpsPart] _parts(const int64_t[:, ::1] parts):
    """A table's rows (WorkerCore.add_table) as native partitions."""
    cdef Py_ssize_t i, n = parts.shape[0]
    cdef vector[BpsPart] table
    cdef BpsPart p
    table.reserve(n)
    for i in range(n):
        p.key = <uint64_t>parts[i, 0]
        p.offset = <uint64_t>parts[i, 1]
        p.length = <uint64_t>parts[i, 2]
        p.server = <int32_t>parts[i, 3]
        p.staging = <unsigned char *><uintptr_t>parts[i, 4]
        p.desc.pid = <int32_t>parts[i, 5]
        p.desc.fd = <int32_t>parts[i, 6]
        p.desc.inode = <uint64_t>parts[i, 7]
        p.desc.offset = <uint64_t>parts[i, 8]
        p.desc.length = p.length
        p.owner = <int32_t>parts[i, 9] if parts.shape[1] > 9 else -1
        p.colocated = parts[i, 10] != 0 if parts.shape[1] > 10 else False
        p.compress = parts[i, 11] != 0 if parts.shape[1] > 11 else False
        p.nccl_root = <int32_t>parts[i, 12] if parts.shape[1] > 12 else -1
        table.push_back(p)
    return table


cdef unsigned char *_address(buf, uint64_t *nbytes) except? NULL:
    """The address and length of ``buf``'s bytes; the caller keeps ``buf`` (and so its memory) alive."""
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    nbytes[0] = view.len
    PyBuffer_Release(&view)
    return <unsigned char *>view.buf


cdef class WorkerCore:
    cdef BpsWorkerCore *core
    cdef readonly int servers

    def __cinit__(self, uint32_t node_id, int64_t credit, double timeout, int nthreads, int notify_fd):
        if not available:
            raise RuntimeError(f"the native worker core is unavailable: {unavailable_reason}")
        self.core = new BpsWorkerCore(node_id, credit, timeout, nthreads, notify_fd)
        self.servers = 0

    def __dealloc__(self):
        if self.core != NULL:
            with nogil:
                self.core.stop()
            del self.core
            self.core = NULL

    def add_server(self):
        """Server ``self.servers`` (authenticated already); its link follows (add_link, add_ucx_link)."""
        if not self.core.add_server():
            raise RuntimeError("too many servers for one job")
        self.servers += 1

    def add_server_live(self, int fd):
        """A server that joined the running job (elastic servers): its direct TCP link's fd. It becomes
        server ``self.servers``."""
        if not self.core.add_server_live(fd):
            raise RuntimeError("too many servers for one job")
        self.servers += 1

    def hold(self, dead):
        """Elastic servers, step 1: servers ``dead`` are gone; ops submitted from now on wait. Returns
        the number of ops submitted so far on each table (by table id)."""
        cdef vector[int] d = list(dead)
        return list(self.core.hold(d))

    def commit(self, alive, list segments):
        """Elastic servers, step 2: ``segments`` is [(table id, first op number, rows)] with rows as
        :meth:`add_table` takes them; a dead server's partitions go to the replacement among ``alive``
        (the new membership's servers, in order), held ops start."""
        cdef vector[int] a = list(alive)
        cdef vector[int64_t] tables
        cdef vector[uint64_t] start
        cdef vector[vector[BpsPart]] segs
        for table, first, rows in segments:
            tables.push_back(table)
            start.push_back(first)
            segs.push_back(_parts(rows))
        self.core.commit(a, tables, start, segs)

    def add_segment(self, int64_t table, uint64_t first, const int64_t[:, ::1] rows):
        """A table registered after the servers changed: the partitions it uses from op ``first`` on."""
        self.core.add_segment(table, first, _parts(rows))

    def set_elastic(self, bint on):
        """BYTEPS_ELASTIC=1 (before start()): keep each key's latest result for a lost server's replacement."""
        self.core.set_elastic(on)

    def set_direct_spin(self, double seconds):
        """How long a direct caller polls for its reply before it sleeps (BYTEPS_SPIN_US; before start())."""
        self.core.set_direct_spin(seconds)

    def set_lone_machine(self, bint on):
        """The job has one worker machine (before start()): an owner's local sum is the result, with no
        server round trip (core/stages.py)."""
        self.core.set_lone_machine(on)

    def set_colocated(self, int server, bint on):
        """Whether server ``server`` is on this machine: a lost server's partitions moved to it may go
        through shared memory, and those moved elsewhere must not."""
        self.core.set_colocated(server, on)

    @property
    def results_sent(self):
        """RESULTs sent to lost servers' replacements."""
        return self.core.results_sent()

    def lost_links(self):
        """Servers whose direct link broke since the last call."""
        cdef vector[int] out
        self.core.lost_links(&out)
        return list(out)

    def add_link(self, int server, int fd):
        """Hand over a direct TCP link to server ``server`` (core/transport/bps_link.h): a connected socket whose
        token the server accepted. The native thread owns the fd from now on and closes it."""
        if not 0 <= server < self.servers:
            raise ValueError(f"no server {server} (have {self.servers})")
        self.core.add_link(server, fd)

    def add_ucx_link(self, int server, str host, int port, bytes token, bytes ident, double timeout):
        """A UCX endpoint to server ``server``'s listener (core/transport/bps_ucx.h), admitted by ``token`` for
        ``ident``, before start(): "" once it is up, else why not.
        Blocks up to ``timeout`` seconds for the server's answer (without the GIL)."""
        if not 0 <= server < self.servers:
            raise ValueError(f"no server {server} (have {self.servers})")
        cdef string why, h = host.encode(), t = token, i = ident
        with nogil:
            why = self.core.add_ucx_link(server, h, port, t, i, timeout)
        return why.decode("utf-8", "replace")

    def link_transport(self, int server):
        """How server ``server`` is reached: "tcp", "ucx: <UCX transports/devices>", or "" (no link: lost)."""
        return self.core.link_transport(server).decode("utf-8", "replace")

    @property
    def links_up(self):
        """How many servers are reached over a working direct link (the others are lost)."""
        return self.core.links_up()

    def add_local(self, router, int local_rank, int local_size):
        """Hand over our local ROUTER: what comes there (late peers' handshakes and link offers) is
        forwarded to Python (:meth:`forwarded_local`). The links to the local ranks follow
        (:meth:`add_local_link`)."""
        self.core.add_local(<void *><uintptr_t>router.underlying, local_rank, local_size)

    def add_local_link(self, int local_rank, int fd, bytes ident, int ring_fd=-1, bint low=False):
        """Hand over a direct TCP link to local rank ``local_rank`` (after :meth:`add_local`, before
        start), whose token was checked; ``ident`` is that rank's DEALER identity toward our ROUTER.
        The native thread owns the fd from now on. ``ring_fd`` >= 0: the pair's shared-memory rings
        (:data:`RING_REGION_BYTES`; ``low``: we are the lower rank; the caller still owns ``ring_fd``).
        Returns "" or why the rings could not be mapped (both ends then fall back to the DEALER)."""
        return self.core.add_local_link(local_rank, fd, ident, ring_fd, low).decode()

    @property
    def local_links_up(self):
        """How many other local ranks are reached over a working direct link."""
        return self.core.local_links_up()

    def set_local_joined(self, uint64_t mask):
        """join(): the local ranks (bit n: local rank n) whose copies owners no longer wait for."""
        self.core.set_local_joined(mask)

    def set_join_ends(self, uint64_t ends):
        """join() has ended ``ends`` times: the parity our LOCAL_READYs carry (FLAG_JOIN_EPOCH)."""
        self.core.set_join_ends(ends)

    def set_self_joined(self, bint on):
        """This process is in join() (``on``), or its join ended: it reduces its peers' copies of the
        partitions it owns (see :meth:`owed`)."""
        self.core.set_self_joined(on)

    def owed(self):
        """Partitions this joined process owns whose copies arrived: [(wire key, round, dtype, bytes)],
        each to be answered with :meth:`submit_owed`."""
        cdef vector[BpsOwed] got
        self.core.owed(&got)
        return [(o.key, o.rnd, o.dtype, o.length) for o in got]

    def submit_owed(self, int64_t op_id, int64_t table, uint64_t rnd, int dtype, buf):
        """Reduce a partition this joined process owns (``table``: its one row) in round ``rnd``: its
        peers' copies, pushed and pulled, the result handed back to them. ``buf``: zeros of the
        partition's size (kept alive by the caller until the op is forgotten)."""
        cdef uint64_t nbytes
        cdef unsigned char *data = _address(buf, &nbytes)
        self.core.submit_owed(op_id, table, rnd, dtype, data, nbytes)

    def forwarded_local(self):
        """Local messages the native side does not own: [[identity, header, body]] as bytes."""
        cdef vector[vector[string]] got
        self.core.forwarded_local(&got)
        return [[PyBytes_FromStringAndSize(s.data(), s.size()) for s in f] for f in got]

    def local_stats(self):
        """Partitions reduced natively, of those on the stage thread, and copies handed to owners;
        ``for_peers``: partitions this process reduced for its local peers while in join()."""
        return {"reduced": self.core.local_reduced(), "reduced_on_thread": self.core.local_reduced_on_thread(),
                "coordinated": self.core.local_coordinated(), "for_peers": self.core.owed_submitted(), "owner_direct": self.core.local_owner_direct(),
                "links_up": self.core.local_links_up(), "rings_up": self.core.local_rings_up(),
                "link_sent": self.core.local_link_sent(), "link_received": self.core.local_link_received()}

    def set_credit(self, int64_t credit):
        """The send queue's byte credit from now on (the job's partition size changed)."""
        self.core.set_credit(credit)

    @property
    def credit(self):
        """The send queue's byte credit."""
        return self.core.credit()

    def credit_stalls(self):
        """(times the send queue's head went past a stalled credit, the first such tensor's name)."""
        cdef string first
        cdef uint64_t n = self.core.credit_stalls(&first)
        return n, first.decode("utf-8", "replace")

    def start(self):
        self.core.start()

    def stop(self):
        with nogil:
            self.core.stop()

    def add_table(self, str name, const int64_t[:, ::1] parts, codec=None, int64_t codec_of=-1):
        """Register a tensor's partitions once; returns the id :meth:`submit` takes. ``parts`` rows:
        wire key, offset, length, server, staging address (0: none), the staging region's
        descriptor: pid, fd, inode, offset, (local reduce) the owner's local rank (-1: no local
        reduce) and whether the server is colocated, whether its push is encoded by ``codec``, and (a
        CUDA push_pull on the NCCL stages) its root's local rank (-1: none): core/table_rows.py.
        ``codec``: the table's wire codec, (method id, flags, levels, k, seed, momentum mu, nesterov,
        this worker's rank) as byteps.compression.WireCompressor has them, or None
        (core/pipeline/worker_codec.h keeps each partition's state across the table's ops).
        ``codec_of``: instead, the codec (and state) of that table (a joined process's partition it
        pushes for its peers: the tensor's own table)."""
        cdef BpsTableCodec wire_codec
        if codec is None or codec_of >= 0:
            return self.core.add_table(name.encode(), _parts(parts), NULL, codec_of)
        (wire_codec.method, wire_codec.flags, wire_codec.levels, wire_codec.k, wire_codec.seed, wire_codec.mu,
         wire_codec.nesterov, wire_codec.stream) = codec
        return self.core.add_table(name.encode(), _parts(parts), &wire_codec, -1)

    def submit(self, int64_t op_id, int64_t table, int cmd, int dtype, uint32_t root, int64_t priority,
               bint root_self, buf, bint lazy=False, uint32_t divisor=1):
        """Start a push_pull/broadcast of ``buf`` (a flat writable buffer kept alive by the caller
        until the op is forgotten) over a table from :meth:`add_table`. One call per operation, with
        no per-partition work: the buffer's address is read through the buffer protocol. ``lazy``:
        its completion waits for the caller (:meth:`wait_op`) before :meth:`wait` reports it
        (BPS_LAZY_DELIVERY_S), unless :meth:`prompt` is called. ``divisor``: an average of a float
        push_pull, divided into each partition's result as it is copied into ``buf`` (1: a sum)."""
        cdef uint64_t nbytes
        cdef unsigned char *data = _address(buf, &nbytes)
        # with the GIL held: the call only takes the core's mutex briefly and writes an eventfd, and
        # releasing the GIL here would let another Python thread take it for up to a switch interval
        self.core.submit_table(op_id, table, cmd, dtype, root, priority, root_self, data, nbytes, lazy,
                                      divisor)

    def submit_abandon(self, int64_t op_id, int64_t table, int cmd, int dtype, uint32_t root, bint root_self, buf,
                       str reason):
        """This rank refused a call on ``table``'s tensor: an op (``buf``: zeros of the tensor's size, kept alive
        by the caller, never sent) whose partitions take the rounds the call would have had and push
        ``reason`` instead of data, so the servers fail those rounds on every rank (core/wire.py
        FLAG_ABANDON). It completes like any op, with the servers' error."""
        cdef uint64_t nbytes
        cdef unsigned char *data = _address(buf, &nbytes)
        self.core.submit_abandon(op_id, table, cmd, dtype, root, root_self, data, nbytes, reason.encode())

    def enable_gpu(self, str cudart, uint64_t slot_bytes, int slots):
        """Once, before the first :meth:`submit_gpu` (any time, from one thread): load the CUDA runtime at
        ``cudart``, with a staging ring of ``slots`` page-locked buffers of ``slot_bytes``
        (core/pipeline/gpu_copier.h). Raises RuntimeError saying why it cannot be loaded."""
        cdef string why = self.core.enable_gpu(cudart.encode(), slot_bytes, slots)
        if why.size():
            raise RuntimeError(why.decode(errors="replace"))

    def enable_nccl(self, str path):
        """Once, after :meth:`enable_gpu` and :meth:`add_local`, before the first :meth:`submit_gpu` on a table
        whose partitions have NCCL roots: load NCCL at ``path`` for the machine's NCCL stages
        (core/pipeline/nccl_stages.h). Raises RuntimeError saying why it cannot be loaded."""
        cdef string why = self.core.enable_nccl(path.encode())
        if why.size():
            raise RuntimeError(why.decode(errors="replace"))

    def submit_gpu(self, int64_t op_id, int64_t table, int cmd, int dtype, uint32_t root, int64_t priority,
                   bint root_self, uint64_t dev_ptr, int device, uint64_t nbytes, uint64_t ready_event,
                   uint64_t done_event, bint lazy=False, uint32_t divisor=1):
        """:meth:`submit` for a CUDA tensor: ``nbytes`` of device memory at ``dev_ptr`` on ``device``,
        copied off the GPU and back per partition after the producer's ``ready_event`` (a cudaEvent_t,
        0: none); ``done_event`` (0: none) is recorded on byteps' stream after the last copy, for the
        caller's stream to wait on. Python touches none of its bytes."""
        self.core.submit_gpu(op_id, table, cmd, dtype, root, priority, root_self, dev_ptr, device, nbytes,
                             ready_event, done_event, lazy, divisor)

    def gpu_stats(self):
        """{"copies": COPYD2H and COPYH2D issued, "peak_slots": most staging slots held at once, "grown":
        slots added to the ring because partitions waited for one with none coming back, "collectives":
        NCCL_REDUCEs and NCCL_BROADCASTs issued}."""
        return {"copies": self.core.gpu_copies(), "peak_slots": self.core.gpu_peak_slots(),
                "grown": self.core.gpu_grown(), "collectives": self.core.nccl_collectives()}

    def submit_direct(self, int64_t op_id, int64_t table, int cmd, int dtype, uint32_t root, int64_t priority,
                      bint root_self, buf, uint32_t divisor=1):
        """A synchronous call's fast path (BpsWorkerCore::submit_direct): run the op's round trip on
        this thread, without the GIL, when byteps-net is idle; True if it ran (done, or handed to
        byteps-net after a short wait), False if the fast path does not apply (then :meth:`submit`)."""
        cdef uint64_t nbytes
        cdef unsigned char *data = _address(buf, &nbytes)
        cdef cbool ran
        with nogil:
            ran = self.core.submit_direct(op_id, table, cmd, dtype, root, priority, root_self, data, nbytes, divisor)
        return ran

    @property
    def direct_calls(self):
        """Synchronous calls whose round trip ran on the caller's thread."""
        return self.core.direct_calls()

    def stage_entries(self):
        """{stage code: partitions moved into that stage so far} (BpsWorkerCore::step: byteps-net's
        and direct callers' partitions alike)."""
        return {code: self.core.entered(code) for code in range(1, BPS_STAGE_COUNT + 1)}

    @property
    def compressed_pushes(self):
        """Partitions byteps-net pushed encoded by their table's wire codec."""
        return self.core.compressed_pushes()

    @property
    def replies_in_place(self):
        """Replies whose sum a server's link read straight into their partition's bytes (no PULL copy)."""
        return self.core.replies_in_place()

    @property
    def direct_adopted(self):
        """Direct calls handed to byteps-net because their reply took longer than the window."""
        return self.core.direct_adopted()

    def answer_local(self, bytes ident, bytes header, bytes body):
        """Queue ``[header, body]`` on our local ROUTER for the local peer ``ident`` (a handshake's
        answer), in order with byteps-net's own messages there."""
        cdef BpsRawSend *m = new BpsRawSend()
        m.ident, m.header, m.body = ident, header, body
        with nogil:
            self.core.send_raw(m)  # m belongs to the native thread now

    def reset_rounds(self):
        self.core.reset_rounds()

    def fail_all(self):
        self.core.fail_all()

    def is_done(self, int64_t op_id):
        return self.core.is_done(op_id)

    @property
    def lazy_late(self):
        """Lazy ops that :meth:`wait` reported because their caller had not taken them in time."""
        return self.core.lazy_late()

    def prompt(self, int64_t op_id):
        """Op ``op_id`` has a done callback: report its completion to :meth:`wait` at once (not lazily)."""
        self.core.prompt(op_id)

    def wait_op(self, int64_t op_id, int timeout_ms):
        """Wait up to ``timeout_ms`` without the GIL for one op; its (error kind, error text) once it
        completed, else None."""
        cdef cbool done
        cdef BpsOp *op
        with nogil:
            done = self.core.wait_op(op_id, timeout_ms)
        if not done:
            return None
        op = self.core.op(op_id)
        if op == NULL:
            return (OK, "")
        return (op.error_kind, op.error.decode("utf-8", "replace"))

    def wait(self, int timeout_ms):
        """Completed ops, waiting up to ``timeout_ms`` without the GIL: [(id, error kind, error text)]."""
        cdef vector[int64_t] ids
        cdef BpsOp *op
        with nogil:
            self.core.completions(&ids, timeout_ms)
        out = []
        for i in ids:
            op = self.core.op(i)
            if op != NULL:
                out.append((i, op.error_kind, op.error.decode("utf-8", "replace")))
        return out

    def forget(self, int64_t op_id):
        """Free a completed op; False while ZeroMQ still reads its tensor (ask again later)."""
        return self.core.forget(op_id)

    def forwarded(self):
        """Messages the native side does not own: [(server index, [frames as bytes])]."""
        cdef vector[BpsForward] got
        self.core.forwarded(&got)
        return [(f.server, [PyBytes_FromStringAndSize(s.data(), s.size()) for s in f.frames]) for f in got]

    def bytes_sent(self, int server):
        return self.core.bytes_sent(server)

    def bytes_received(self, int server):
        return self.core.bytes_received(server)


cdef extern from *:
    """
    #include <sys/ioctl.h>
    /* Both ends of one shared-memory local link in this process, over a socketpair (RingPair). */
    struct BpsRingPair {
        BpsShmLink *end[2] = {nullptr, nullptr};
        std::string open() {
            int sv[2];
            if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return std::string("socketpair: ") + strerror(errno);
            int mfd = memfd_create("byteps-ring", MFD_CLOEXEC);
            if (mfd < 0 || ftruncate(mfd, (off_t)BPS_RING_REGION) != 0) return std::string("memfd: ") + strerror(errno);
            for (int i = 0; i < 2; ++i) {
                void *m = mmap(nullptr, BPS_RING_REGION, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
                if (m == MAP_FAILED) return std::string("mmap: ") + strerror(errno);
                end[i] = new BpsShmLink(sv[i], m, i == 0);
            }
            ::close(mfd);
            return "";
        }
        ~BpsRingPair() { close(0); close(1); }
        void close(int i) { delete end[i]; end[i] = nullptr; }
        int send(int i, const std::string &a, const std::string &b) {
            BpsFrames f;
            f.copy(a.data(), a.size());
            f.copy(b.data(), b.size());
            return end[i]->send(f);
        }
        int recv(int i, std::vector<std::string> *out) {
            BpsMessage m;
            int rc = end[i]->recv(&m);
            out->clear();
            for (int k = 0; rc == 1 && k < m.count; ++k) out->emplace_back((const char *)m.data(k), m.size(k));
            return rc;
        }
        int socket_bytes(int i) {
            int n = 0;
            ioctl(end[i]->fd(), FIONREAD, &n);
            return n;
        }
    };
    """
    cppclass BpsRingPair:
        string open()
        void close(int i)
        int send(int i, const string &a, const string &b)
        int recv(int i, vector[string] *out)
        int socket_bytes(int i)
        BpsShmLinkEnd **end


cdef extern from "core/transport/bps_link.h":
    cppclass BpsShmLinkEnd "BpsShmLink":
        cbool dead()
        cbool wants_write()
        cbool pending_input()
        cbool arm_to_sleep()
        void poll_ring(cbool on)
        const string &error()


cdef class RingPair:
    """Both ends (0: the lower rank's, 1: the higher's) of one shared-memory local link, in this
    process over a socketpair: tests of core/transport/bps_link.h BpsShmLink (wrap-around, a full ring, bells,
    a peer that closes) without a job around it."""
    cdef BpsRingPair pair

    def __cinit__(self):
        why = self.pair.open().decode()
        if why:
            raise OSError(why)

    cdef BpsShmLinkEnd *_end(self, int i) except NULL:
        if i not in (0, 1) or self.pair.end[i] == NULL:
            raise ValueError(f"end {i} is closed or does not exist")
        return self.pair.end[i]

    def send(self, int i, bytes a, bytes b):
        """Send the message [a, b] from end ``i``: 0, or -1 once the link is dead."""
        self._end(i)
        return self.pair.send(i, a, b)

    def recv(self, int i):
        """One message at end ``i``: its frames, None if none is complete, or -1 once the link is dead."""
        cdef vector[string] out
        self._end(i)
        rc = self.pair.recv(i, &out)
        if rc < 0:
            return -1
        return [bytes(s) for s in out] if rc == 1 else None

    def wants_write(self, int i):
        return self._end(i).wants_write()

    def pending_input(self, int i):
        return self._end(i).pending_input()

    def poll_ring(self, int i, bint on):
        self._end(i).poll_ring(on)

    def arm_to_sleep(self, int i):
        return self._end(i).arm_to_sleep()

    def socket_bytes(self, int i):
        """Bell bytes waiting in end ``i``'s socket (FIONREAD)."""
        self._end(i)
        return self.pair.socket_bytes(i)

    def error(self, int i):
        return self._end(i).error().decode()

    def dead(self, int i):
        return self._end(i).dead()

    def close(self, int i):
        """Close end ``i`` (its socket and mapping), as a peer process that exits."""
        self._end(i)
        self.pair.close(i)
