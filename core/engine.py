"""The worker's communication engine: one background thread that owns every socket.

Why a dedicated thread (as in Horovod's background loop):

1. ZeroMQ sockets are not thread-safe; one owner thread means no locks around them.
2. push_pull must be asynchronous: gradient hooks enqueue work and return at once, so
   communication overlaps back-propagation.
3. Heartbeats must keep flowing while the training thread computes, or a busy worker
   would look dead to the scheduler.
4. Timeouts need one place that sees every outstanding request and can say who it waited for.

Flow of one operation (:class:`Op`):

* The training thread calls :meth:`Engine.submit`; the op is queued and the engine woken
  through a pipe.
* New (name, shape, dtype) combinations are declared to the scheduler, which compares them
  across workers and returns one tensor key (or a mismatch error for every worker).
* The tensor's bytes are cut into partitions of at most BYTEPS_PARTITION_BYTES; partition i of
  tensor key t has wire key ``t << 32 | i``; which server sums it, and how long it is, is decided
  by byteps/placement.py (BYTEPS_PLACEMENT), in the paper's optimal k/n proportions.
  Partitions wait in a priority queue with a byte credit (core/_pipeline.pyx). Each is sent
  zero-copy from the tensor's memory, or to a server on this machine as a shared-memory
  descriptor (core/shm.py); with several processes per machine, one process per partition
  sums the machine's copies first (core/local.py), or, with BYTEPS_LOCAL_STRATEGY=topology, the
  machine's topology plan does on its own thread and hands the engine its ranges (core/local_exec.py,
  :meth:`Engine.push_range`).
* With a wire compressor (``Op.codec``, byteps/compression.py), the native core encodes a partition
  for a server on another machine (with its error-feedback state) and sends it with FLAG_COMPRESSED,
  and decodes a compressed reply into the tensor (core/pipeline/worker_codec.h); this engine does so
  only for a process that runs its local reduce in Python after join().
* Each reply is copied once into the tensor's memory, from ZeroMQ's message buffer or from the
  server's shared store; when the last partition is back the op completes and its event is set.

No Python runs per element; Python work is per partition: a header, a few dict operations, and
one C call per message (core/transport.py: libzmq called directly, not pyzmq per frame).
"""
import collections
import dataclasses
import fcntl
import itertools
import os
import socket
import threading
import time

import numpy as np
import zmq

from byteps import autotune, compression, config, cpus, timeline
from byteps.errors import BytePSError, BytePSTimeoutError, ConfigError, PeerLostError, ProtocolError, TensorMismatchError
from byteps.log import logger
from byteps.placement import Placement

from . import auth, dtypes, shm, stages, transport, wire
from ._pipeline import PriorityQueue
from ._reduce import aligned_empty, copy_into, sum_many
from .control import ControlClient
from .local import ComputeStage, LocalPlan
from .ops import Op, RangeOp
from .stages import Stage
from .threads import name_native

from . import _worker_core

#: partitions at least this large are copied into shared memory (STAGE) and summed (LOCAL_REDUCE) on
#: their stage's thread; smaller ones inline, where the thread hand-off (a GIL round trip between two
#: threads) would cost more than the copy or sum (bench_push_pull.py --overhead)
STAGE_THREAD_MIN_BYTES = 256 << 10

#: the send queue's head goes past the credit after this long without progress (no partition sent or
#: answered): only workers that disagree on a tensor's priority ever need it (core/pipeline/bps_queue.h)
CREDIT_STALL_S = 1.0

Cmd = wire.Cmd
#: the operation kinds of core/stages.py and of tensor declarations (the scheduler compares them)
#: plain ints: pyzmq's flag enums cost a microsecond per operation
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
KINDS = {Cmd.PUSHPULL: "push_pull", Cmd.BROADCAST: "broadcast", Cmd.ASYNC_PUSHPULL: "async push_pull"}


@dataclasses.dataclass(frozen=True)
class _TableSpec:
    """What a native table's partitions depend on (elastic servers rebuild them per membership)."""
    name: str
    tkey: int
    nbytes: int
    dtype: int
    cmd: int
    root: int
    pset: object = None
    codec: object = None  # the wire compressor of its push_pulls (byteps.compression.WireCompressor), or None

    @property
    def cut_name(self):
        """How the scheduler names this tensor's op count: the same on every worker (a broadcast's
        root and the others have different tables, and their ops count together)."""
        return f"{self.tkey}:{int(self.cmd)}:{self.nbytes}"


class Engine:
    def __init__(self, cfg):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self._inbox = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        fcntl.fcntl(self._wake_w, fcntl.F_SETFL, os.O_NONBLOCK)
        fcntl.fcntl(self._wake_r, fcntl.F_SETFL, os.O_NONBLOCK)
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self.failure = None
        self.book = None
        self._cpu_slot = None  # (index, count) among the job's worker processes on this host
        self.rank = self.size = None
        self.tuning = None          # autotune.Agreement: the job's partition size and this worker's credit
        self._agreed = None         # the scheduler's release of the agreement (see _tune)
        self._thread = threading.Thread(target=self._main, name="byteps-engine", daemon=True)
        # engine-thread state
        self._parts = {}            # (wire key, round) -> (op, offset, nbytes)
        self._push_started = {}     # (wire key, round) -> when its PUSH began (only while tracing)
        self._declaring = {}        # (name, seq, set id) -> [ops waiting for the key]
        self._decl_spec = {}        # (name, seq, set id) -> spec
        self._decl_pending = {}     # (name, spec) -> (name, seq, set id) of its declaration in flight
        self._decl_seq = collections.Counter()
        self._keys = {}             # (name, spec) -> tensor key
        self._requests = {}         # ("barrier"|"leave", name) -> event set on release
        self.barrier_values = {}    # barrier name -> {rank: value} of a barrier whose members sent values
        self.barrier_errors = {}    # barrier name -> the scheduler's reason for failing it
        self._left = False
        self.servers = []
        # bytes (header + body frames) sent to / received from each server index on the data sockets
        self.bytes_sent = collections.Counter()
        self.bytes_received = collections.Counter()
        # Partitions wait here for the network: larger priority first, then the smaller wire key
        # (one order on every worker), and at most BYTEPS_SCHEDULING_CREDIT partitions' bytes on
        # the wire, so an urgent tensor can overtake a large one queued earlier.
        self._sendq = PriorityQueue(cfg.scheduling_credit * cfg.partition_bytes)
        self._stall_noted = False
        self._python_credit_stalls = 0
        self.python_partitions = collections.Counter()  # Stage -> partitions Python ran from it (metrics())
        self._tasks = {}            # task id -> (op, partition index, offset, nbytes)
        self._task_ids = itertools.count()
        # shared memory with servers on this machine (core/shm.py)
        self._shm = None
        self._maps = shm.PeerMaps()
        self._staging = {}          # wire key -> (shared view, descriptor prefix) of this worker's copy
        self.colocated = []         # per server: exchange data through shared memory
        # intra-machine aggregation (core/local.py)
        self.local = None           # LocalPlan when this machine's processes reduce together
        self._local_sock = None     # ROUTER: LOCAL_READY / LOCAL_DONE from this machine's other processes
        self._local_peers = {}      # local rank -> DEALER to its ROUTER
        self._link_offers = {}      # local rank -> (port, token, DEALER identity, ring offer or None): links offered
        self._io = {}               # data-plane socket -> its message I/O (core/transport.py)
        self._expected_for, self._expected_copies = None, 0  # see _local_copies_expected
        self._compute = None        # ComputeStage running the owner's sums (LOCAL_REDUCE)
        self._copier = None         # ComputeStage copying partitions into shared memory (STAGE)
        self._dropped = stages.from_env()  # optional stages switched off by BYTEPS_PIPELINE
        self._stage_lists = {}      # (owner, colocated, kind) -> the partition's stages (core/stages.py)
        self._groups = {}           # (wire key, round) -> owner's state of one partition's local reduce
        self._early = collections.defaultdict(list)  # (wire key, round) -> LOCAL_READY views before the op
        self._early_meta = {}       # (wire key, round) -> (dtype, nbytes) of those early copies
        self._awaiting_done = {}    # (wire key, round) -> (op, offset, nbytes) of a partition another rank owns
        # join() (Horovod): ranks that joined add zeros; a joined process still owns its partitions
        self.joined = frozenset()   # ranks that have joined
        # joins this process saw end; LOCAL_READY carries its parity (FLAG_JOIN_EPOCH), so a copy that a
        # local peer sent after a join ended is never adopted by a process that has not yet heard the end
        self._joins_ended = 0
        self._early_next = set()    # (wire key, round) of early copies sent after a join this process still runs
        self._gate = auth.Gate(None)  # who may send to our local ROUTER (set up in _knock_all)
        self.join_result = None     # the last rank to join, once every rank has
        # BYTEPS_LOCAL_STRATEGY=topology: the thread running the plan's executor (core/local_exec.py)
        self._local_exec = None
        # the native data plane (core/pipeline/bps_worker.h): owns the server sockets once authenticated
        self._native = None
        self._native_ops = {}       # native id -> Op, until its completion is delivered
        self._native_ids = itertools.count(1)
        self._native_parts = {}     # (tkey, nbytes, cmd, root_self) -> (native table id, partitions)
        self._native_specs = {}     # native table id -> _TableSpec (elastic servers rebuild its partitions)
        self._native_lock = threading.RLock()  # staging regions: allocated by the engine and submitting threads
        self._keepalive = {}        # token -> body ZeroMQ still reads (Python's zero-copy sends)
        self._keep_tokens = itertools.count()
        self._graveyard = {}        # native id -> Op whose tensor ZeroMQ may still read (failed ops)
        self._completer = None      # thread delivering native completions
        self.native_submitted = 0   # ops handed to the native thread (tests check the path really ran)
        self.native_averaged = 0    # of them, averages the native core divided as it copied the sums in
        # the native thread also runs this machine's local reduce (core/pipeline/bps_worker.h "Local reduce"):
        # set once at start from the job's config, so every local rank decides alike
        self._native_local = False
        self._owed_zeros = {}  # bytes -> zeros: a joined owner's own (absent) copy (_reduce_owed)
        self.native_local_submitted = 0  # push_pulls the native thread reduced locally

    # ---------------------------------------------------------------- training-thread side

    def start(self):
        """Start the thread, register, and wait for the address book (bounded by BYTEPS_TIMEOUT)."""
        self._thread.start()
        limit = self.cfg.timeout + 5
        if not self._ready.wait(limit):
            self.failure = self.failure or BytePSTimeoutError(
                f"init() waited {limit:g} s for the scheduler at {self.cfg.scheduler_endpoint} to start the job")
        if self.failure is not None:
            self.stop()
            raise self.failure
        if self._cpu_slot is not None:  # the training thread: the one that polls (byteps/cpus.py)
            cpus.bind_worker(*self._cpu_slot, self.cfg.cpu_bind)

    def submit(self, op, sync=False):
        """Start ``op``. ``sync``: the caller waits for it at once (a synchronous API call), so a small
        op may run its round trip on this thread (BpsWorkerCore::submit_direct)."""
        if self.failure is not None:
            raise self.failure
        if self._local_exec is not None and self._local_exec.takes(op):
            self._local_exec.enqueue(op)  # in submission order; it runs once the key is known
        elif not self._inbox and self._native_eligible(op):
            key = self._keys.get((op.name, op.spec))
            if key is not None and self._native_submit(op, key, sync, lazy=True):  # declared before: no engine hop
                return op
        self._inbox.append(op)
        self._wake()
        return op

    def push_range(self, rop):
        """Push a RangeOp and pull the global sum into its buffer (any thread; core/local_exec.py).
        ``rop.done`` is set when every partition is back or the range failed (``rop.error``)."""
        if self.failure is not None:
            raise self.failure
        self._inbox.append(rop)
        self._wake()
        return rop

    def request(self, kind, name="", value=None):
        """Run a control-plane collective ("barrier" or "leave"); return an event set on release.

        A barrier with a ``value`` hands every member all of them: ``barrier_values[name]`` maps each
        rank to its value once the event is set."""
        ev = threading.Event()
        self._inbox.append((kind, name, ev, value))
        self._wake()
        return ev

    def stop(self):
        """Stop the thread (after shutdown's release, or to abandon the job) and free the wake pipe."""
        self._stopped.set()
        self._wake()
        self._thread.join(10)
        if self._wake_w is not None:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = None

    def _wake(self):
        if self._wake_w is None:
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full, so the engine is awake anyway
            pass

    # ---------------------------------------------------------------- engine thread

    def _main(self):
        name_native()
        try:
            self._setup()
            self._loop()
        except BytePSError as e:
            self._abort(e)
        except Exception as e:  # a bug: fail every caller loudly rather than hang them
            logger.exception("byteps engine thread crashed")
            self._abort(BytePSError(f"byteps engine thread crashed: {e!r}"))
        finally:
            self._close()
            self._ready.set()

    # ---------------------------------------------------------------- native data plane

    def _start_native(self):
        """Hand the authenticated server sockets to the native thread (core/pipeline/bps_worker.h)."""
        if not _worker_core.available:
            from ._transport import unavailable_reason
            raise BytePSError(f"the native worker core cannot run here: {unavailable_reason}")
        from ._reduce import get_num_threads

        core = _worker_core.WorkerCore(self.control.node_id, self.cfg.scheduling_credit * self.cfg.partition_bytes,
                                       self.cfg.timeout, get_num_threads(), self._wake_w)
        core.set_direct_spin(self.cfg.spin_us * 1e-6)
        for sock in self.servers:
            self.poller.unregister(sock)
            core.add_server(sock)
        self._open_links(core)
        # the local reduce too, unless the topology executor does it (core/local_exec.py)
        if self.local is not None and self.cfg.local_strategy != "topology":
            links = self._open_local_links()
            self.poller.unregister(self._local_sock)
            core.add_local(self._local_sock, dict(self._local_peers), self.cfg.local_rank, self.local.size,
                           self._gate.secret is None)
            core.set_lone_machine(self.cfg.num_worker == 1)  # the same rule as stages.stage_list(machines=)
            for lr, (fd, ident, ring_fd, low) in links.items():
                why = core.add_local_link(lr, fd, ident, -1 if ring_fd is None else ring_fd, low)
                if why:
                    logger.warning("local rank %d: its link's shared-memory rings could not be mapped (%s); its "
                                   "local messages go through ZeroMQ", lr, why)
                if ring_fd is not None:
                    os.close(ring_fd)  # the native mapping keeps the memory
            for identity in self._gate.admitted():
                core.allow_local(identity)
            self._native_local = True
            logger.info("native local reduce: %d processes on this machine, sums >= %d bytes on thread "
                        "byteps-reduce, %d of %d local peers over direct links (%d through shared-memory "
                        "rings)", self.local.size, STAGE_THREAD_MIN_BYTES, core.local_links_up,
                        len(self._local_peers), core.local_stats()["rings_up"])
        if timeline.recorder is not None:
            timeline.recorder.add_native(_worker_core.trace_buffer())
        core.set_elastic(self.cfg.elastic)
        for i, shared in enumerate(self.colocated):
            core.set_colocated(i, shared)
        core.start()
        self._native = core
        self._completer = threading.Thread(target=self._deliver_native, name="byteps-complete", daemon=True)
        self._completer.start()
        logger.info("native data plane: partitions to %d servers on thread byteps-net (%d over direct TCP links)",
                    len(self.servers), core.links_up)

    def _open_links(self, core):
        """Direct TCP links to the servers (core/transport/bps_link.h): ask each for a one-time token over the
        authenticated ZeroMQ socket, connect, present it, and hand the socket to the native thread. A
        server that cannot listen for links stays on ZeroMQ (logged)."""
        from . import ucx
        use_ucx = ucx.choose(self.cfg.transport, _worker_core) == "ucx"
        poller, asked = zmq.Poller(), {}
        for i, sock in enumerate(self.servers):
            sock.send_multipart(wire.control(Cmd.LINK, self.control.node_id))
            poller.register(sock, zmq.POLLIN)
            asked[sock] = i
        answers, limit = {}, min(self.cfg.timeout, 10.0)
        deadline = time.monotonic() + limit
        while asked and time.monotonic() < deadline:
            for sock, _ in poller.poll(timeout=100):
                frames = sock.recv_multipart()
                try:
                    header = wire.unpack(frames[0])
                    if header.cmd == Cmd.LINK:
                        answers[asked.pop(sock)] = wire.decode(frames[1]) if len(frames) > 1 else {}
                except ProtocolError as e:
                    logger.warning("malformed answer while opening direct links: %s", e)
                # anything else here is a late PROBE echo (a timed-out probe): dropped
        for sock, i in asked.items():
            logger.warning("server %d did not answer LINK within %g s: its data goes through ZeroMQ", i, limit)
        for i, answer in sorted(answers.items()):
            info = self.book["servers"][i]
            if "error" in answer:
                logger.info("server %d: %s; its data goes through ZeroMQ", i, answer["error"])
                continue
            ident = self.servers[i].getsockopt(zmq.IDENTITY)
            if use_ucx:
                self._open_ucx_link(core, i, info["host"], answer, ident)
                continue
            try:
                fd = transport.open_link(info["host"], int(answer["port"]), bytes.fromhex(answer["token"]),
                                         ident, self.control.node_id, min(self.cfg.timeout, 10.0))
            except (OSError, ValueError, KeyError, TypeError, ProtocolError) as e:  # TypeError: no TCP port
                logger.warning("no direct link to server %d (%s:%s): %s; its data goes through ZeroMQ", i,
                               info["host"], answer.get("port"), e)
                continue
            core.add_link(i, fd)

    def _open_local_links(self):
        """Direct links to this machine's other worker processes (core/pipeline/bps_worker.h, "Local links"),
        after the local handshake: {local rank: (socket fd, its DEALER identity toward our ROUTER, ring
        fd or None, whether we are the lower rank)}.

        Each pair has one link; the higher local rank listens on 127.0.0.1. It offers each lower rank a
        one-time token over its authenticated DEALER (Cmd.LINK {port, token}, behind its AUTH on the
        same pipe); the lower rank connects and presents the token, as a worker does to a server
        (transport.open_link). Everyone first offers, then connects upward, then accepts from below:
        the highest rank waits for nobody, so no wait is circular. A pair whose link does not come up
        within the time limit stays on ZeroMQ (logged with the local rank waited for).

        The offer also names a memfd of shared-memory rings that the higher rank made for the pair ({"ring": {pid, fd, inode}}); the lower rank opens it and says so in its
        hello (arg 1), and then both ends carry the link's bytes through it (core/transport/bps_link.h
        BpsShmLink). A ring that does not open leaves that pair on the TCP socket alone."""
        me, node = self.cfg.local_rank, self.control.node_id
        lower = sorted(lr for lr in self._local_peers if lr < me)
        higher = sorted(lr for lr in self._local_peers if lr > me)
        limit = min(self.cfg.timeout, 10.0)
        links, expected, listener, rings = {}, {}, None, {}
        if lower:
            fd, port = transport.listen_link("127.0.0.1")
            listener = socket.socket(fileno=fd)
            for lr in lower:
                token = os.urandom(transport.TOKEN_BYTES)
                expected[token] = lr
                offer = {"port": port, "token": token.hex(), "local_rank": me}
                try:
                    rings[lr], offer["ring"] = shm.ring_region(_worker_core.RING_REGION_BYTES)
                except OSError as e:
                    logger.info("no shared-memory ring for local rank %d (%s): its link stays on TCP", lr, e)
                self._local_peers[lr].send_multipart(wire.control(Cmd.LINK, node, offer))
        poller = zmq.Poller()
        poller.register(self._local_sock, zmq.POLLIN)
        if listener is not None:
            poller.register(listener.fileno(), zmq.POLLIN)

        def serve(timeout_ms):  # our ROUTER (offers, late knocks) and, below us, connections
            for sock, _ in poller.poll(timeout=timeout_ms):
                if sock is self._local_sock:
                    self._drain_data(sock, self._on_local)
                elif listener is not None and sock == listener.fileno():
                    self._accept_local_link(listener, expected, links, limit, rings)
            self.control.tick()

        for lr in higher:
            deadline = time.monotonic() + limit
            while lr not in self._link_offers and time.monotonic() < deadline:
                serve(100)
            offer = self._link_offers.pop(lr, None)
            if offer is None:
                logger.warning("local rank %d offered no direct link within %g s; "
                               "its local messages go through ZeroMQ", lr, limit)
                continue
            port, token, ident, ring_info = offer
            ring_fd = None
            if ring_info is not None:
                try:
                    ring_fd = shm.open_ring(ring_info, _worker_core.RING_REGION_BYTES)
                except ProtocolError as e:
                    logger.info("local rank %d: %s; its link stays on TCP", lr, e)
            try:
                fd = transport.open_link("127.0.0.1", port, token, self._local_peers[lr].getsockopt(zmq.IDENTITY),
                                         node, limit, arg=int(ring_fd is not None))
            except (OSError, ProtocolError) as e:
                logger.warning("no direct link to local rank %d (127.0.0.1:%s): %s; its local messages go "
                               "through ZeroMQ", lr, port, e)
                if ring_fd is not None:
                    os.close(ring_fd)
                continue
            links[lr] = (fd, ident, ring_fd, True)
        deadline = time.monotonic() + limit
        while any(lr not in links for lr in lower) and time.monotonic() < deadline:
            serve(100)
        for lr in lower:
            if lr not in links:
                logger.warning("local rank %d did not open its direct link within %g s; its local messages go "
                               "through ZeroMQ", lr, limit)
        for ring_fd in rings.values():  # offered, not taken
            os.close(ring_fd)
        if listener is not None:
            listener.close()
        return links

    def _accept_local_link(self, listener, expected, links, limit, rings):
        """A connection on our local link listener: admitted if it presents a token we offered; its
        hello's arg 1 says it mapped the ring we offered (``rings``: local rank -> our ring fd)."""
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        try:
            conn.settimeout(limit)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            frames = transport.link_recv(conn)
            header = wire.unpack(frames[0])
            body = frames[1] if len(frames) > 1 else b""
            lr = expected.pop(body[:transport.TOKEN_BYTES], None) if header.cmd == Cmd.LINK else None
            ident = body[transport.TOKEN_BYTES:]
            if lr is not None and not self._gate.allows(ident):  # its AUTH may still wait on our ROUTER
                self._drain_data(self._local_sock, self._on_local)
            if lr is None or not self._gate.allows(ident):
                logger.warning("refused a local direct link: its token does not match one we offered")
                conn.sendall(transport.link_pack([wire.pack(Cmd.LINK, sender=self.control.node_id, arg=0)]))
                return
            conn.sendall(transport.link_pack([wire.pack(Cmd.LINK, sender=self.control.node_id, arg=1)]))
            conn.setblocking(False)
            ring_fd = rings.pop(lr, None) if header.arg == 1 else None
            links[lr] = (conn.detach(), ident, ring_fd, False)
        except (OSError, ProtocolError) as e:
            logger.warning("a local direct link failed its handshake: %s", e)
        finally:
            conn.close()  # after detach() this closes nothing

    def _open_ucx_link(self, core, i, host, answer, ident):
        """A UCX endpoint to server ``i`` (core/transport/bps_ucx.h), admitted by the token of its LINK answer;
        a server without a UCX listener, or a failed handshake, leaves it on ZeroMQ (logged)."""
        if "ucx_port" not in answer:
            logger.warning("server %d has no UCX listener (its BYTEPS_TRANSPORT is not ucx); its data goes "
                           "through ZeroMQ", i)
            return
        why = core.add_ucx_link(i, host, int(answer["ucx_port"]), bytes.fromhex(answer["token"]), ident,
                                min(self.cfg.timeout, 10.0))
        if why:
            logger.warning("no UCX link to server %d (%s:%s): %s; its data goes through ZeroMQ", i, host,
                           answer["ucx_port"], why)
        else:
            logger.info("server %d: UCX link (%s)", i, core.link_transport(i))

    @property
    def native_direct_calls(self):
        """Synchronous calls whose round trip ran on the caller's thread (tests check the path ran)."""
        return self._native.direct_calls if self._native is not None else 0

    @property
    def native_link_transports(self):
        """Per server, what carries its link: "tcp", "ucx: <UCX transports>" or "" (ZeroMQ)."""
        if self._native is None:
            return []
        return [self._native.link_transport(i) for i in range(len(self.servers))]

    @property
    def native_links(self):
        """Servers this worker reaches over a working direct link, TCP or UCX (tests check the path really ran)."""
        return self._native.links_up if self._native is not None else 0

    def _native_eligible(self, op):
        """Ops the native thread runs whole: plain push_pulls (through the machine's local reduce when
        it has several processes), broadcasts (never reduced locally: core/stages.py), both in a
        process set (its members push themselves, past the local reduce) and asynchronous push_pulls
        (a delta each, answered with the server's parameters). A function of
        the op and the job's config only, so every local rank takes the same path for an op; after
        join() a process runs its local reduce in Python (the native side routes each partition's
        LOCAL_READY / LOCAL_DONE to whichever side runs it, so ranks that switch at different moments
        still meet). Only a process that joined switches; its peers' ops stay native."""
        # what stays on this engine's Python partition path: a joined process's local reduce (the
        # topology executor's ranges go native through _native_submit_range; compressed ops are encoded
        # by the native core: core/pipeline/worker_codec.h). A process set's op is native: its members
        # push themselves (no local reduce), and the servers know how many members push its key before
        # any member has the key (scheduler/scheduler.py)
        if type(op) is not Op or (self._wire_codec(op) is not None and self.cfg.elastic):
            return False  # elastic servers: a compressed op is refused (_dispatch says so)
        if op.pset is not None or op.cmd == Cmd.ASYNC_PUSHPULL:  # never reduced locally
            return not self.cfg.elastic  # only plain push_pulls and broadcasts move to a new server
        if op.cmd == Cmd.BROADCAST:
            return True
        return op.cmd == Cmd.PUSHPULL and (self.local is None or self._native_local)

    def _native_table(self, op, tkey):
        """(table id, partitions) of ``op``'s tensor in the native core, registered on first use: per
        partition its wire key, offset, length, server and staging region (colocated server). With
        elastic servers, each later membership's partitions too, from the op number the scheduler cut
        that membership's change at (a tensor first used after a change still counts its ops from 0)."""
        root_self = op.cmd == Cmd.BROADCAST and op.root == self.rank
        codec = self._wire_codec(op)
        # the key fixes name, shape and dtype; a table keeps its codec's state, so one per codec setting
        ident = (tkey, op.buf.nbytes, op.cmd, root_self, self._codec_ident(codec))
        entry = self._native_parts.get(ident)
        if entry is not None:
            return entry
        spec = _TableSpec(op.name, tkey, op.buf.nbytes, op.dtype, op.cmd, op.root, op.pset, codec)
        with self._native_lock:  # the staging allocator is shared with the engine thread
            first, *later = self._memberships
            table = self._native.add_table(op.name, self._table_rows(spec, first), self._codec_settings(codec))
            for m in later:
                self._native.add_segment(table, m["cuts"].get(spec.cut_name, 0), self._table_rows(spec, m))
            count = len(self._table_rows(spec, self._memberships[-1])) if later else None
            entry = (table, count if count is not None else len(first["placement"].partitions(
                tkey, op.buf.nbytes, dtypes.itemsize(op.dtype))))
            self._native_parts[ident] = entry
            self._native_specs[table] = spec
        return entry

    def _table_rows(self, op, membership):
        """The native table rows of a tensor (a _TableSpec) under one server membership (see _native_table)."""
        tkey = op.tkey
        local = self.local is not None and op.cmd == Cmd.PUSHPULL and op.pset is None
        parts = membership["placement"].partitions(tkey, op.nbytes, dtypes.itemsize(op.dtype))
        ids, members = membership["ids"], membership["members"]
        rows = np.zeros((len(parts), 12), dtype=np.int64)
        rows[:, 9] = -1
        for row, (i, off, length, at) in enumerate(parts):
            server = ids[at]  # placement numbers the membership's servers 0..S-1; the core, the job's
            key = wire.make_key(tkey, wire.member_partition(i, members))
            rows[row, :4] = (key, off, length, server)
            rows[row, 11] = self._compresses(op.codec, op.dtype, op.nbytes, length, server)
            if local:  # every partition has a shared region: the owner sums into it, the others copy into it
                view, (pid, fd, inode, base) = self._region(key, length)
                rows[row, 4:11] = (view.ctypes.data, pid, fd, inode, base, self.local.owner(tkey, i),
                                   self.colocated[server])
            elif self.stages_of(op, i, server)[0] == Stage.STAGE and length:
                view, (pid, fd, inode, base) = self._region(key, length)
                rows[row, 4:9] = (view.ctypes.data, pid, fd, inode, base)
        return rows

    def _wire_codec(self, op):
        """The wire compressor that encodes ``op``'s pushes: a plain push_pull's (a process set's ops
        travel raw: docs/compression.md), or None."""
        return op.codec if op.cmd == Cmd.PUSHPULL and op.pset is None else None

    @staticmethod
    def _codec_ident(codec):
        """What a native table's codec state depends on: the codec's method and options (None: no codec)."""
        if codec is None:
            return None
        return (codec.method_id, codec.flags, codec.levels, codec.k, codec.seed, codec.momentum, codec.nesterov,
                codec.min_bytes)

    def _codec_settings(self, codec):
        """A native table's codec (WorkerCore.add_table): its options and this worker's rank, or None."""
        if codec is None:
            return None
        return (codec.method_id, codec.flags, codec.levels, float(codec.k or 0), codec.seed, codec.momentum,
                codec.nesterov, self.rank)

    def _compresses(self, codec, dtype, tensor_nbytes, length, server):
        """Whether the native core encodes a partition's push: a server on another machine (a colocated
        one reads shared memory) and a codec that applies to its size."""
        return codec is not None and not self.colocated[server] and codec.applies(dtype, tensor_nbytes, length)

    def _native_submit(self, op, tkey, sync=False, lazy=False):
        """Hand ``op`` to the native thread (``sync``: or run it on this thread if it is small and the
        native thread idle); False if it refused (a local-reduce op after join(): the caller runs it
        in Python). ``lazy``: its completion is left to its caller for a while (see prompt()); only
        where the caller submits it itself, since a caller that started an op still being declared
        waits on its event, which only a delivery sets."""
        op.tkey = tkey
        table, count = self._native_table(op, tkey)
        if not count:  # an empty tensor: nothing to send
            op._finish()
            return True
        nid = next(self._native_ids)
        op.parts_left = count
        self._native_ops[nid] = op  # before submit: the completion thread may deliver it at once
        root_self = op.cmd == Cmd.BROADCAST and op.root == self.rank
        op.divided = op.divisor > 1  # the native core divides as it copies each partition's sum in; set before
        # submit, which the completion thread may race to deliver
        if not (sync and count == 1 and self._native.submit_direct(nid, table, op.cmd, op.dtype, op.root,
                                                                   op.priority, root_self, op.buf, op.divisor)) and \
                not self._native.submit(nid, table, op.cmd, op.dtype, op.root, op.priority, root_self, op.buf,
                                        lazy=lazy, divisor=op.divisor):
            op.divided = False
            del self._native_ops[nid]
            return False
        self.native_submitted += 1
        self.native_averaged += op.divided
        if self.local is not None and op.cmd == Cmd.PUSHPULL and op.pset is None:
            self.native_local_submitted += 1
        # only now: the native side reads an id it does not hold as "finished and forgotten", so a
        # poll() or synchronize() that saw the id before submit() would finish the op with no data
        op.native_id = nid
        return True

    def credit_stalls(self):
        """Times a send queue's head went past a stalled credit, in either engine (CREDIT_STALL_S)."""
        native = self._native.credit_stalls()[0] if self._native is not None else 0
        return self._python_credit_stalls + native

    def native_local_stats(self):
        """The native local reduce's counters (tests check the path really ran), or None."""
        if not self._native_local:
            return None
        return dict(self._native.local_stats(), ops=self.native_local_submitted)

    def _deliver_native(self):
        """Completion thread: sets the events of ops the native thread finished (per op, not per partition)."""
        name_native()
        core = self._native
        while not self._stopped.is_set():
            for nid, kind, text in core.wait(200):
                self._deliver(nid, kind, text)
            for nid in [n for n in self._graveyard if core.forget(n)]:
                del self._graveyard[nid]

    def _deliver(self, nid, kind, text):
        """Finish a native op once, on whichever thread gets there first (completion thread or a caller
        in synchronize()): set its error, its event, run its callbacks, free the native record."""
        op = self._native_ops.pop(nid, None)  # atomic: only one thread gets the op
        if op is None:
            return
        if kind != _worker_core.OK and op.error is None:
            op.error = self._native_error(op, kind, text)
        op.parts_left = 0
        op._finish()
        if not self._native.forget(nid):  # ZeroMQ still reads the tensor (a failed op): keep it alive
            self._graveyard[nid] = op

    def native_wait(self, op, timeout):
        """Wait up to ``timeout`` s for a native op without the GIL and finish it on this thread."""
        got = self._native.wait_op(op.native_id, int(timeout * 1000))
        if got is not None:
            self._deliver(op.native_id, *got)
        return op.done.is_set()

    def _native_error(self, op, kind, text):
        if kind == _worker_core.ERR_SERVER:
            try:
                msg = wire.decode(text.encode()).get("error", "unknown error")
            except ProtocolError as e:
                msg = str(e)
            return TensorMismatchError(f"push_pull of tensor {op.name!r} failed: {msg}")
        if kind == _worker_core.ERR_TIMEOUT:
            secs, late = text.split("|", 1)
            if late.startswith(("server", "local rank")):  # not "its turn to be sent (...)", nor a server change
                late += (" (a server waits for every machine's push of this tensor and logs the ranks that are "
                         "late; a local rank waits for its machine's other processes)")
            return BytePSTimeoutError(f"push_pull of tensor {op.name!r} waited {secs} s "
                                      f"(BYTEPS_TIMEOUT={self.cfg.timeout:g}) for {late}")
        if kind == _worker_core.ERR_ABORT:
            return self.failure or BytePSError("the byteps engine stopped")
        return ProtocolError(text)

    def native_done(self, op):
        """True once the native thread has finished ``op`` (any thread; no GIL hand-off needed). The op
        is finished (event, callbacks) by synchronize(), or by the completion thread later."""
        core = self._native
        return core is not None and core.is_done(op.native_id)

    def prompt(self, op):
        """``op`` has a done callback now: have the completion thread deliver it as soon as it is done.

        Native ops their caller submits are lazy: their completion waits (BPS_LAZY_DELIVERY_S,
        core/pipeline/bps_worker.h) for the caller's synchronize() to finish them on its own thread, so the
        completion thread does not take the GIL from a training thread for ops nobody listens to yet."""
        if op.native_id is not None and self._native is not None:
            self._native.prompt(op.native_id)

    def _drain_native(self):
        """Replies the native thread does not own (Python's partitions), and released zero-copy bodies."""
        for server, frames in self._native.forwarded():
            self._on_data(server, frames)
        if self._native_local:  # handshakes of late local peers, Python's partitions
            for frames in self._native.forwarded_local():
                self._on_local(None, frames)
            for key, rnd, dtype, nbytes in self._native.owed():  # we are in join()
                self._reduce_owed(key, rnd, dtype, nbytes)
        for token in self._native.released():
            self._keepalive.pop(token, None)
        for server in self._native.lost_links():
            if self.cfg.elastic:  # the scheduler removes it at once, rather than after its heartbeat time-out
                logger.warning("the direct link to server %d broke: reporting it to the scheduler", server)
                self.control.send(Cmd.SUSPECT, {"server": server})

    def _next_round(self, key):
        return self._native.next_round(key)  # one count per key, whichever side sends the partition

    def _send_data(self, server, header, body):
        """Send a data message to a server from Python, through the native thread, which owns the sockets."""
        token = next(self._keep_tokens)
        if self._native.send(server, header, body, token):
            self._keepalive[token] = body  # alive until the native thread has sent it

    def transport_bytes(self):
        """Bytes sent to / received from each server on the data sockets (both paths)."""
        sent, received = collections.Counter(self.bytes_sent), collections.Counter(self.bytes_received)
        if self._native is not None:
            for i in range(len(self.servers)):
                sent[i] += self._native.bytes_sent(i)
                received[i] += self._native.bytes_received(i)
        return {"sent": {k: v for k, v in sent.items() if v}, "received": {k: v for k, v in received.items() if v}}

    def metrics(self):
        """What this worker's data plane did so far, for users, tests and bench/ (byteps.metrics())."""
        traffic = self.transport_bytes()
        links = self.native_link_transports
        placement = getattr(self, "placement", None)  # set once the address book is in
        # the placement numbers the servers of the current membership by position (docs/elastic.md)
        memberships = getattr(self, "_memberships", None)  # set once the address book is in
        ids = memberships[-1]["ids"] if memberships else list(range(len(self.servers)))
        place = {sid: pos for pos, sid in enumerate(ids)} if placement is not None else {}
        servers = [{"index": i, "colocated": bool(self.colocated[i]),
                    "role": placement.roles[place[i]] if i in place else "removed",
                    "weight": placement.weights[place[i]] if i in place else 0,
                    "transport": (links[i] if i < len(links) else "") or "zeromq",
                    "bytes_sent": traffic["sent"].get(i, 0), "bytes_received": traffic["received"].get(i, 0)}
                   for i in range(len(self.servers))]
        native = self._native
        return {
            "servers": servers,
            "partition_bytes": placement.partition_bytes if placement is not None else None,
            "credit_bytes": self._sendq.credit,
            "tensors": {name: tkey for (name, _), tkey in self._keys.items()},
            "native": {"ops": self.native_submitted, "averaged": self.native_averaged,
                       "direct_calls": self.native_direct_calls, "links_up": self.native_links,
                       "direct_adopted": native.direct_adopted if native is not None else 0,
                       "results_sent": native.results_sent if native is not None else 0,
                       # partitions it pushed encoded by their wire compressor (core/pipeline/worker_codec.h)
                       "compressed_pushes": native.compressed_pushes if native is not None else 0,
                       "local_reduce": self.native_local_stats(),
                       # partitions byteps-net moved into each stage of their lists (worker_stages.h)
                       "stages": {Stage(code).label: n for code, n in native.stage_entries().items() if n}
                       if native is not None else {}},
            # partitions that moved through this Python engine, by their first stage on this process
            "python_partitions": {stage.label: n for stage, n in self.python_partitions.items()},
            "credit_stalls": self.credit_stalls(),
            "local_group": self.local.size if self.local else None,  # processes whose copies are summed locally
            "local_strategy": "topology" if self._local_exec is not None else "native",
        }

    def _abort(self, error):
        self.failure = self.failure or error
        if self._native is not None:
            self._native.fail_all()
        for op in list(self._outstanding_ops()):
            op.fail(self.failure)
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, Op):
                item.fail(self.failure)
            else:
                item[2].set()
        for ev in self._requests.values():
            ev.set()

    def _outstanding_ops(self):
        seen = set()
        for op in itertools.chain((v[0] for v in self._parts.values()),
                                  (v[0] for v in self._tasks.values() if v[0] != "reduced"),
                                  (v[0] for v in self._awaiting_done.values()),
                                  (g["op"] for g in self._groups.values())):
            if id(op) not in seen:
                seen.add(id(op))
                yield op
        for ops in self._declaring.values():
            yield from ops

    def _setup(self):
        info = {"role": "worker", "host": self.cfg.node_host, "worker_id": self.cfg.worker_id,
                "local_rank": self.cfg.local_rank, "local_size": self.cfg.local_size,
                "local_reduce": self.cfg.local_reduce and self.cfg.local_size > 1 and not self.cfg.enable_async
                and Stage.LOCAL_REDUCE not in self._dropped}
        if info["local_reduce"]:
            self._local_sock = self.ctx.socket(zmq.ROUTER)
            self._local_sock.setsockopt(zmq.LINGER, 0)
            info["local_port"] = self._local_sock.bind_to_random_port("tcp://127.0.0.1")
            self._io[self._local_sock] = transport.wrap(self._local_sock)
        if self.cfg.timeline:
            timeline.start(self.cfg).wake = self._wake
        self.control = ControlClient(self.ctx, self.cfg, info)
        self.poller = zmq.Poller()
        self.poller.register(self.control.sock, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.control.register()
        deadline = time.monotonic() + self.cfg.timeout
        while self.book is None:
            if self._stopped.is_set():
                raise BytePSError("init() was interrupted")
            if self.poller.poll(timeout=min(self.cfg.heartbeat_interval, 1.0) * 1000):
                self._on_control()
            self.control.tick()
            if time.monotonic() > deadline:
                raise BytePSTimeoutError(f"the scheduler at {self.cfg.scheduler_endpoint} did not start the job "
                                         f"within {self.cfg.timeout:g} s (BYTEPS_TIMEOUT); its log names the "
                                         "nodes that never registered")
        self._place_on_cpus()
        for info in self.book["servers"]:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, auth.new_identity())  # unguessable: see core/auth.py
            sock.connect(f"tcp://{info['host']}:{info['port']}")
            self.poller.register(sock, zmq.POLLIN)
            self.servers.append(sock)
            self._io[sock] = transport.wrap(sock)
        self._server_index = {sock: i for i, sock in enumerate(self.servers)}
        # which server sums which bytes: the k/n split of byteps/placement.py, the same on every worker
        self.placement = Placement.from_book(self.book, self.cfg.placement, self.cfg.partition_bytes, self.rank)
        logger.info("%s", self.placement.describe())
        if self.cfg.enable_ipc:
            # same host address too: network namespaces share a kernel (the probe passes) but are
            # separate hosts, whose traffic must cross their network (bench/netns.py)
            self.colocated = [shm.can_share(info.get("shm"), self._maps) and info["host"] == self.cfg.node_host
                              for info in self.book["servers"]]
        else:
            self.colocated = [False] * len(self.servers)
        if any(self.colocated):
            logger.info("shared memory with servers %s", [i for i, c in enumerate(self.colocated) if c])
        if self.book.get("local_reduce") and self._local_sock is not None:  # a 1-process machine pushes itself
            self._setup_local()
        self._knock_all()
        if Stage.STAGE in self._dropped:  # BYTEPS_PIPELINE=-stage: colocated servers over TCP too
            self.colocated = [False] * len(self.servers)
        self._tune()  # before anything is cut into partitions or sent
        # every server membership of the job so far, in order (elastic servers, docs/elastic.md); the
        # first one's placement is the one _tune() rebuilt with the job's partition size
        self._memberships = [{"members": 0, "placement": self.placement, "cuts": {},
                              "ids": [info["index"] for info in self.book["servers"]]}]
        self._change = None  # (PREPARE body, when it came) while the scheduler changes the servers
        if any(self.colocated) or self.local is not None:
            self._shm = shm.Allocator("byteps-worker")
        if any(self.colocated):
            self._copier = ComputeStage(self._wake, name="byteps-copy")
        self._start_native()
        if self.cfg.elastic:  # the scheduler changes servers only once every worker can hold and commit
            self.control.send(Cmd.MEMBERS, {"phase": "ready"})
        from . import local_exec
        self._local_exec = local_exec.start(self)  # None unless BYTEPS_LOCAL_STRATEGY=topology applies
        self._ready.set()

    def _tune(self):
        """Partition size (job-wide) and credit (this worker's) from the link (byteps/autotune.py).

        Probe one server unless BYTEPS_PARTITION_BYTES and BYTEPS_SCHEDULING_CREDIT are both set
        (with local reduce only local rank 0 probes: its machine's processes share one NIC), then
        agree through the scheduler: every worker's proposal comes back to all, and all apply the
        same rule to the same list, so the partition sizes cannot differ.
        """
        started = time.monotonic()
        env = os.environ
        weights, me = self.placement.weights, self.cfg.node_host
        shape = autotune.job_shape(self.book["servers"], weights, me,
                                   self.placement.min_cut if self.cfg.placement == "balanced" else 0)
        both_set = all((env.get(v) or "").strip() for v in ("BYTEPS_PARTITION_BYTES", "BYTEPS_SCHEDULING_CREDIT"))
        measurement = None
        if not both_set and (self.local is None or self.cfg.local_rank == 0):
            measurement = autotune.test_link(env) or self._probe(
                autotune.probe_target(self.book["servers"], weights, me, self.rank))
        # a machine that reduces locally keeps the Python engine's per-piece cost in the model, as it had before
        # its local reduce moved into the native core (not re-measured since; byteps/autotune.py)
        mine = autotune.propose(measurement, shape, self.cfg.placement,
                                autotune.PIECE_COST_NATIVE if self.local is None else autotune.PIECE_COST_PYTHON,
                                self.cfg.worker_id, env)
        self.control.send(Cmd.BARRIER, {"name": autotune.AGREE_BARRIER, "value": mine})
        # the scheduler answers, naming the ranks it lacks, after BYTEPS_TIMEOUT; this wait is longer
        limit = self.cfg.timeout + 5
        deadline = time.monotonic() + limit
        while self._agreed is None:
            if self._stopped.is_set():
                raise BytePSError("init() was interrupted")
            if time.monotonic() > deadline:
                raise BytePSTimeoutError(
                    f"init() waited {limit:g} s for the scheduler at {self.cfg.scheduler_endpoint} to hand out the "
                    "job's partition size (it needs every worker's link probe; its log names the ranks it lacks)")
            for sock, _ in self.poller.poll(timeout=100):
                if sock is self.control.sock:
                    self._drain(sock, lambda _: self._on_control())
                elif sock is self._local_sock:  # this machine's other processes may still knock
                    self._drain_data(sock, self._on_local)
                elif sock == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif sock in self._server_index:  # a late PROBE echo (a timed-out probe): drop it
                    self._drain_data(sock, lambda s, frames: None)
            self.control.tick()
        if "error" in self._agreed:
            raise BytePSTimeoutError(f"the job's partition size was not agreed: {self._agreed['error']}")
        tuning = autotune.agree(self._agreed["values"], self.rank, shape, env)
        self.tuning = tuning = tuning._replace(took_s=time.monotonic() - started)
        self.cfg = dataclasses.replace(self.cfg, partition_bytes=tuning.partition_bytes,
                                       scheduling_credit=tuning.credit)
        # nothing is queued or cut yet: rebuild both with the agreed values
        self._sendq = PriorityQueue(tuning.credit * tuning.partition_bytes)
        self.placement = Placement.from_book(self.book, self.cfg.placement, tuning.partition_bytes, self.rank)
        logger.info("%s; %.0f ms", tuning.text, tuning.took_s * 1e3)

    def _probe(self, server):
        """Time PROBE echoes to one server (autotune.probe); None, with a warning, if it fails."""
        if server is None:
            return None
        who = f"server {server} ({self.book['servers'][server]['host']}:{self.book['servers'][server]['port']})"
        try:
            echo = autotune.zmq_echo(self.servers[server], self.control.node_id, min(5.0, self.cfg.timeout))
            return autotune.probe(echo, autotune.PROBE_SIZES, autotune.PROBE_REPEATS, autotune.PROBE_BUDGET_S)
        except (BytePSError, ValueError) as e:
            logger.warning("could not probe the link to %s (%s); proposing no partition size", who, e)
            return None

    def _knock_all(self):
        """Authenticate to every server and local peer (core/auth.py) before sending them anything.

        Our own local ROUTER is served meanwhile: the machine's other processes knock on it too.
        """
        secret = auth.job_secret()
        self._gate = auth.Gate(secret)
        if secret is None:
            return
        waiting = {}
        for i, sock in enumerate(self.servers):
            waiting[sock] = (auth.Knock(secret, sock.getsockopt(zmq.IDENTITY)), f"server {i}")
        for lr, sock in self._local_peers.items():
            waiting[sock] = (auth.Knock(secret, sock.getsockopt(zmq.IDENTITY)), f"local rank {lr}")
        for sock, (knock, _) in waiting.items():
            sock.send_multipart(wire.control(Cmd.HELLO, self.control.node_id, knock.hello()))
        for sock in self._local_peers.values():  # only the CHALLENGE ever comes back on these
            self.poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + self.cfg.timeout
        while waiting:
            if time.monotonic() > deadline:
                raise BytePSTimeoutError("no authentication answer within BYTEPS_TIMEOUT from "
                                         + ", ".join(who for _, who in waiting.values()))
            for sock, _ in self.poller.poll(timeout=100):
                if sock is self._local_sock:
                    self._drain_data(sock, self._on_local)
                elif sock is self.control.sock:
                    self._on_control()
                elif sock in waiting:
                    header, body = wire.unpack(sock.recv()), {}
                    if sock.getsockopt(zmq.RCVMORE):
                        body = wire.decode(sock.recv())
                    self._discard(sock)
                    knock, who = waiting.pop(sock)
                    if header.cmd != Cmd.CHALLENGE:
                        raise BytePSError(f"{who} answered {Cmd(header.cmd).name} to our HELLO: "
                                          f"{body.get('error', 'does it use the same BYTEPS_JOB_SECRET?')}")
                    try:
                        mac = knock.answer(body, who)
                    except auth.AuthError as e:
                        raise PeerLostError(str(e)) from None
                    sock.send_multipart(wire.control(Cmd.AUTH, self.control.node_id, {"mac": mac}))
            self.control.tick()
        for sock in self._local_peers.values():
            self.poller.unregister(sock)

    def _place_on_cpus(self):
        """Where this process stands among the job's worker processes on this host: start() binds the
        training thread to a CPU where they fill its CPUs, and callers poll longer where they outnumber
        them (byteps/cpus.py, BYTEPS_CPU_BIND, BYTEPS_SPIN_US=auto). Counted per host address, not per
        machine of the job: bpslaunch --local runs several "machines" on one host."""
        here = sorted((w["worker_id"], w["local_rank"]) for w in self.book["workers"]
                      if w["host"] == self.cfg.node_host)
        me = (self.cfg.worker_id, self.cfg.local_rank)
        if me not in here:  # registered under another address: count ourselves alone
            here = [me]
        self._cpu_slot = (here.index(me), len(here))
        if self.cfg.spin_auto:
            self.cfg = dataclasses.replace(self.cfg, spin_us=config.auto_spin_us(len(here)))

    def _setup_local(self):
        """Connect to this machine's other worker processes for the local reduce."""
        peers = [w for w in self.book["workers"] if w["worker_id"] == self.cfg.worker_id]
        self.local = LocalPlan(peers, self.cfg.local_rank, self.cfg.local_push)
        for w in self.local.peers:
            if w["local_rank"] == self.cfg.local_rank:
                continue
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, auth.new_identity())
            sock.connect(f"tcp://127.0.0.1:{w['local_port']}")
            self._local_peers[w["local_rank"]] = sock
            self._io[sock] = transport.wrap(sock)
        self.poller.register(self._local_sock, zmq.POLLIN)
        self._compute = ComputeStage(self._wake)
        logger.info("local reduce with %d processes on this machine", self.local.size)

    def _loop(self):
        tick_ms = min(self.cfg.heartbeat_interval, 1.0) * 1000
        next_check = 0.0
        while not self._stopped.is_set():
            # results of inline stages wait in the done queues: look at the sockets, but do not sleep
            ready = ((self._compute is not None and self._compute.done)
                     or (self._copier is not None and self._copier.done))
            events = self.poller.poll(timeout=0 if ready else tick_ms)
            began = time.monotonic()
            for sock, _ in events:
                if sock == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif sock is self.control.sock:
                    self._drain(sock, lambda _: self._on_control())
                elif sock is self._local_sock:  # not when the native thread runs the local reduce
                    self._drain_data(sock, self._on_local)
            self._drain_native()  # the servers' sockets are the native thread's: their replies come from it
            if self._compute is not None:
                while self._compute.done:
                    self._on_reduced(*self._compute.done.popleft())
            if self._copier is not None:
                while self._copier.done:
                    self._on_staged(*self._copier.done.popleft())
            self._drain_inbox()
            now = time.monotonic()
            if now - began > self.cfg.heartbeat_timeout / 3:  # heartbeats wait on this loop: say why they were late
                logger.warning("the engine loop was busy for %.1f s (%d outstanding partitions)", now - began,
                               len(self._parts))
            self.control.tick()
            timeline.flush(self.control)
            if now >= next_check:  # walks every outstanding op: not once per message
                self._check_timeouts()
                if len(self._sendq):  # a stalled credit (CREDIT_STALL_S)
                    self._send_ready()
                if not self._stall_noted:
                    stalls, first = self._native.credit_stalls()
                    if stalls:
                        self._note_stall(repr(first))
                next_check = now + 0.5
            if self._left:  # shutdown() released by the scheduler
                return

    @staticmethod
    def _drain(sock, handle, limit=256):
        """Handle every message already queued on a socket (bounded, so others get a turn)."""
        for _ in range(limit):
            handle(sock)
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                break

    def _drain_data(self, sock, handle, limit=256):
        """As _drain, for data-plane sockets: each message is taken whole, in one C call."""
        io = self._io[sock]
        for _ in range(limit):
            frames = io.recv_multipart()
            if frames is None:
                break
            handle(sock, frames)

    def _close(self):
        ctl = getattr(self, "control", None)
        if self._local_exec is not None:
            self._local_exec.close()
        if self._native is not None:
            self._stopped.set()
            if self._completer is not None:
                self._completer.join(5)
            timeline.remember_threads()  # byteps-net and byteps-reduce, before they end
            self._native.stop()  # before the sockets it owns are closed
            for nid in list(self._native_ops):  # never leave a caller waiting on a stopped thread
                op = self._native_ops.pop(nid, None)
                if op is not None:
                    op.fail(self.failure or BytePSError("byteps shut down while this push_pull was in flight"))
        for stage in (self._compute, self._copier):
            if stage is not None:
                stage.close()
        for sock in [*self.servers, *self._local_peers.values(), self._local_sock]:
            if sock is not None:
                sock.close(linger=0)
        if ctl is not None:
            timeline.flush(ctl, final=True)  # after the native thread stopped: its last spans are in
            ctl.close()
        self.ctx.term()
        self._staging.clear()
        self._maps.close()
        if self._shm is not None:
            self._shm.close()

    # ---------------------------------------------------------------- control messages

    def _on_control(self):
        header, body = self.control.recv()
        cmd = header.cmd
        if cmd in (Cmd.HEARTBEAT, Cmd.CLOCK):  # ControlClient.recv took the clock sample
            return
        if cmd == Cmd.CHALLENGE:
            self.control.on_challenge(body)
            return
        if cmd == Cmd.ADDRBOOK:
            self.book = body
            self.rank = body["you"]["rank"]
            self.size = body["size"]
            self.control.node_id = body["you"]["node_id"]
            self.workers = {w["rank"]: w for w in body["workers"]}
            if body.get("timeline") or timeline.recorder is not None:  # BYTEPS_TIMELINE here or at the scheduler
                self._start_timeline()
        elif cmd == Cmd.DECLARE:
            self._on_declared(body)
        elif cmd == Cmd.BARRIER and body.get("name") == autotune.AGREE_BARRIER:
            self._agreed = body
        elif cmd == Cmd.BARRIER:
            if "error" in body:  # the scheduler gave up on it (members stalled in different collectives)
                self.barrier_errors[body.get("name")] = body["error"]
            if "values" in body:
                self.barrier_values[body.get("name")] = {int(r): v for r, v in body["values"].items()}
            ev = self._requests.pop(("barrier", body.get("name")), None)
            if ev is not None:
                ev.set()
        elif cmd == Cmd.LEAVE:
            self._left = True
            ev = self._requests.pop(("leave", ""), None)
            if ev is not None:
                ev.set()
        elif cmd == Cmd.JOIN:
            self._on_join(body)
        elif cmd == Cmd.TRACE:  # another worker called start_timeline(): record too
            self._start_timeline()
        elif cmd == Cmd.MEMBERS:
            self._on_members(body)
        elif cmd == Cmd.ABORT:
            raise PeerLostError(body.get("reason", "the scheduler aborted the job"))
        elif cmd == Cmd.ERROR:
            raise BytePSError(f"the scheduler refused this worker: {body.get('error')}")
        else:
            logger.warning("unexpected control message %s", Cmd(cmd).name)

    # ---------------------------------------------------------------- elastic servers

    def _on_members(self, body):
        """The scheduler changes the server set in two steps (docs/elastic.md). PREPARE: hold new ops,
        strand a lost server's partitions, connect to joining servers, and answer with how many ops of
        each tensor were submitted. COMMIT: the n-th op of a tensor uses the new membership's
        partitions from the cut (the largest count over all workers) on; stranded partitions go to
        their replacements in their rounds."""
        if body.get("phase") == "prepare":
            began = time.monotonic()
            counts = self._native.hold(body.get("dead", []))
            for info in body.get("joined", []):
                self._join_server(info)
            by_name = collections.Counter()
            for table, n in enumerate(counts):
                spec = self._native_specs.get(table)
                if spec is not None:
                    by_name[spec.cut_name] += n
            self._change = (body, began)
            self.control.send(Cmd.MEMBERS, {"phase": "prepared", "members": body["members"], "counts": by_name})
            return
        if body.get("phase") != "commit":
            logger.warning("unexpected MEMBERS phase %r", body.get("phase"))
            return
        prepared, began = self._change or (body, time.monotonic())
        self._change = None
        servers = body["servers"]
        self.book = dict(self.book, servers=servers)
        self.placement = Placement.from_book(self.book, self.cfg.placement, self.cfg.partition_bytes, self.rank)
        m = {"members": body["members"], "placement": self.placement, "cuts": body.get("cuts", {}),
             "ids": [info["index"] for info in servers]}
        self._memberships.append(m)
        segments = []
        with self._native_lock:
            for ident, (table, _) in list(self._native_parts.items()):
                spec = self._native_specs[table]
                rows = self._table_rows(spec, m)
                segments.append((table, m["cuts"].get(spec.cut_name, 0), rows))
                self._native_parts[ident] = (table, len(rows))
            self._native.commit(m["ids"], segments)
        logger.warning("servers changed (membership %d, %s): servers %s; %s; this worker switched in %.3f s",
                    m["members"], prepared.get("reason", "?"), m["ids"], self.placement.describe(),
                    time.monotonic() - began)

    def _join_server(self, info):
        """Connect to a server that joins the running job: authenticate, open its direct link, and hand
        both to the native thread as server ``info["index"]``."""
        index = info["index"]
        if index != len(self.servers):
            raise BytePSError(f"the scheduler admitted server {index}, but this worker knows {len(self.servers)} "
                              "servers: a membership change was missed")
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, auth.new_identity())
        sock.connect(f"tcp://{info['host']}:{info['port']}")
        limit, who = min(self.cfg.timeout, 10.0), f"server {index} ({info['host']}:{info['port']})"
        secret = auth.job_secret()
        if secret is not None:
            knock = auth.Knock(secret, sock.getsockopt(zmq.IDENTITY))
            header, body = self._ask(sock, wire.control(Cmd.HELLO, self.control.node_id, knock.hello()), limit, who)
            if header.cmd != Cmd.CHALLENGE:
                raise BytePSError(f"{who} answered {Cmd(header.cmd).name} to our HELLO: {body.get('error')}")
            sock.send_multipart(wire.control(Cmd.AUTH, self.control.node_id, {"mac": knock.answer(body, who)}))
        fd = -1
        header, answer = self._ask(sock, wire.control(Cmd.LINK, self.control.node_id), limit, who)
        if header.cmd == Cmd.LINK and "port" in answer:
            try:
                fd = transport.open_link(info["host"], int(answer["port"]), bytes.fromhex(answer["token"]),
                                         sock.getsockopt(zmq.IDENTITY), self.control.node_id, limit)
            except (OSError, ValueError, KeyError, TypeError, ProtocolError) as e:
                logger.warning("no direct link to %s: %s; its data goes through ZeroMQ", who, e)
        shared = (self.cfg.enable_ipc and Stage.STAGE not in self._dropped and info["host"] == self.cfg.node_host
                  and shm.can_share(info.get("shm"), self._maps))
        if shared and self._shm is None:
            self._shm = shm.Allocator("byteps-worker")
        self.colocated.append(shared)
        self._native.set_colocated(index, shared)
        self.servers.append(sock)
        self._native.add_server_live(sock, fd)
        logger.info("%s joined: %s", who, "direct TCP link" if fd >= 0 else "ZeroMQ")

    def _ask(self, sock, frames, limit, who):
        """Send ``frames`` on ``sock`` and wait up to ``limit`` s for its answer: (header, body)."""
        sock.send_multipart(frames)
        if not sock.poll(limit * 1000):
            raise BytePSTimeoutError(f"{who} did not answer {Cmd(wire.unpack(frames[0]).cmd).name} within {limit:g} s")
        got = sock.recv_multipart()
        return wire.unpack(got[0]), (wire.decode(got[1]) if len(got) > 1 else {})

    def _start_timeline(self, path=""):
        """Record spans from now on (start_timeline(), or the scheduler relaying another node's)."""
        rec = timeline.start(self.cfg, path)
        rec.wake = self._wake
        rec.node.update(role="worker", rank=self.rank, worker_id=self.cfg.worker_id, local_rank=self.cfg.local_rank,
                        host=self.cfg.node_host)
        if self._native is not None:
            rec.add_native(_worker_core.trace_buffer())

    def _on_join(self, body):
        if body["done"]:
            # every rank is in join(), nothing is in flight: a sync point where rounds restart at 0
            self.joined = frozenset()
            self._joins_ended += 1
            self._native.reset_rounds()
            self._native.set_join_ends(self._joins_ended)  # before our next op's copies go out
            # nothing of the join is in flight now; copies local peers sent after they heard the end
            # belong to this process's next ops (their rounds restarted at 0 too)
            for ident in [i for i in self._early if i not in self._early_next]:
                del self._early[ident]
                self._early_meta.pop(ident, None)
            self._early_next.clear()
            self.join_result = body["last"]
            if self._native_local:
                self._native.set_local_joined(0)
                self._native.set_self_joined(False)
            ev = self._requests.pop(("join", ""), None)
            if ev is not None:
                ev.set()
            return
        self.joined = frozenset(body["joined"])
        if self.local is None:
            return
        if self._native_local:
            # a joined process has no ops of its own, but owns partitions of its peers' ops: its native
            # core reduces them, adding nothing of its own (_reduce_owed). Owners stop waiting for
            # joined ranks' copies
            if self.rank in self.joined:
                self._native.set_self_joined(True)
            self._native.set_local_joined(sum(1 << w["local_rank"] for w in self.local.peers
                                              if w["rank"] in self.joined))
        if self.rank in self.joined:  # copies other ranks sent us before we joined: we own those partitions
            for ident in [i for i in self._early if i not in self._early_next]:
                self._adopt(*ident)
        for ident in list(self._groups):  # owners stop waiting for local ranks that joined
            self._maybe_reduce(*ident)

    def _on_declared(self, body):
        ident = (body.get("name"), body.get("seq"), body.get("set_id", 0))
        ops = self._declaring.pop(ident, [])
        spec = self._decl_spec.pop(ident, None)
        self._decl_pending.pop((ident[0], spec), None)
        if "error" in body:
            err = TensorMismatchError(body["error"])
            for op in ops:
                op.fail(err)
            return
        self._keys[(ident[0], spec)] = body["key"]
        for op in ops:
            self._dispatch(op, body["key"])

    # ---------------------------------------------------------------- sending

    def _drain_inbox(self):
        done = 0
        while self._inbox:
            done += 1
            if done % 128 == 0:  # a burst (10,000 tensors in one step) must not stop our heartbeats
                self.control.beat()
            item = self._inbox.popleft()
            if not isinstance(item, Op):
                kind, name, ev, value = item
                if kind == "timeline":  # start_timeline(name): record, and tell the scheduler at once
                    self._start_timeline(name)
                    timeline.recorder.flush_due = True
                    ev.set()
                    continue
                self._requests[(kind, name)] = ev
                cmd = {"barrier": Cmd.BARRIER, "leave": Cmd.LEAVE, "join": Cmd.JOIN}[kind]
                self.control.send(cmd, {"name": name} if value is None else {"name": name, "value": value})
                continue
            op = item
            if isinstance(op, RangeOp):  # a range of the topology executor: its key is known
                self._dispatch_range(op)
                continue
            key = self._keys.get((op.name, op.spec))
            if key is not None:
                self._dispatch(op, key)
                continue
            waiting = self._decl_pending.get((op.name, op.spec))  # a dict: 10,000 new tensors stay linear
            if waiting is None:
                set_id = 0 if op.pset is None else op.pset[0]
                seq = self._decl_seq[(op.name, set_id)]  # counted per set: a set's members meet each other
                self._decl_seq[(op.name, set_id)] += 1
                waiting = (op.name, seq, set_id)
                self._decl_spec[waiting] = op.spec
                self._decl_pending[(op.name, op.spec)] = waiting
                self._declaring[waiting] = []
                body = {"name": op.name, "seq": seq, "shape": list(op.shape), "dtype": dtypes.name(op.dtype),
                        "kind": self._declared_kind(op)}
                if op.pset is not None:
                    body.update(set_id=set_id, members=list(op.pset[1]))
                self.control.send(Cmd.DECLARE, body)
            self._declaring[waiting].append(op)

    def _dispatch(self, op, tkey):
        """Cut the op into partitions and queue them for the network."""
        if timeline.recorder is not None:
            timeline.recorder.keys[tkey] = op.name
        if self._local_exec is not None and self._local_exec.owns(op):
            self._local_exec.keyed(op, tkey)  # the topology executor runs it (core/local_exec.py)
            return
        if self._native_eligible(op) and self._native_submit(op, tkey):
            return
        if self.cfg.elastic:  # only the native core re-sends a lost server's partitions (docs/elastic.md)
            op.fail(ConfigError(f"tensor {op.name!r}: BYTEPS_ELASTIC=1 supports plain push_pull and broadcast "
                                "(no compression, process sets, asynchronous training, join() or BYTEPS_LOCAL_STRATEGY=topology)"))
            return
        op.tkey = tkey
        self._queue(op, self.placement.partitions(tkey, op.buf.nbytes, dtypes.itemsize(op.dtype)))

    def _queue(self, op, parts):
        """Put an op's partitions [(index, offset, length, server)] on the send queue; send what fits."""
        op.parts_left = len(parts)
        for i, off, length, _ in parts:
            task = next(self._task_ids)
            self._tasks[task] = (op, i, off, length)
            # ties broken by wire key, one order on every worker (core/pipeline/bps_queue.h says why)
            self._sendq.push(op.priority, task, length, tie=self._wire_key(op, i))
        self._send_ready()

    def _note_stall(self, name):
        """Log (once) that the send queue's head went past a stalled credit (either engine's)."""
        if self._stall_noted:
            return
        self._stall_noted = True
        logger.info("tensor %s went past the scheduling credit: what was in flight had no reply for %.0f s (a "
                    "slow peer, or workers that give a tensor different priorities; logged once)", name,
                    CREDIT_STALL_S)

    @staticmethod
    def _wire_key(op, i):
        """The wire key of partition ``i`` of ``op`` (topology ranges never come here: they are native)."""
        return wire.make_key(op.tkey, i)

    def _send_ready(self):
        """Send every queued partition the credit allows, best first.

        Credit is held only by partitions on the network (released when their reply arrives): a
        local coordination step holds none, or a machine's processes could wait on each other.
        """
        self.control.beat()  # bursts of replies and declarations end here: keep heartbeats flowing
        sent = 0
        while (task := self._sendq.pop(stall=CREDIT_STALL_S)) is not None:
            sent += 1
            if sent % 128 == 0:
                self.control.beat()
            item = self._tasks.pop(task)
            if self._sendq.past_credit:
                self._python_credit_stalls += 1
                self._note_stall(repr(item[0].name) if item[0] != "reduced" else f"key {item[1]:#x} (a machine's sum)")
            if item[0] == "reduced":  # a machine's sum, ready for its server
                self._push_reduced(*item[1:])
                continue
            op, i, off, length = item
            if op.error is not None:  # failed meanwhile (time-out, abort): don't send the rest
                self._sendq.release(length, op.priority, self._wire_key(op, i))
                continue
            key = wire.make_key(op.tkey, i)
            rnd = self._next_round(key)
            data = op.buf[off:off + length]
            server = self.placement.server(op.tkey, i)
            if timeline.recorder is not None:
                timeline.span("QUEUE", int(op.started * 1e9), key, rnd, length, server, op.priority)
            first = self.stages_of(op, i, server)[0]
            self.python_partitions[first] += 1
            if first == Stage.STAGE and length >= STAGE_THREAD_MIN_BYTES:
                self._stage_async(op, key, rnd, server, off, data)
                continue
            if first in (Stage.STAGE, Stage.PUSH):  # a small STAGE copy runs inline, in _push
                self._push(op, key, rnd, server, off, data)
                continue
            self._sendq.release(length, op.priority, key)
            if first == Stage.LOCAL_REDUCE:
                self._early_meta.pop((key, rnd), None)
                self._early_next.discard((key, rnd))
                group = self._groups[(key, rnd)] = {"op": op, "i": i, "off": off, "len": length,
                                                    "views": self._early.pop((key, rnd), [])}
                if self._native_local:  # copies the native thread holds are ours
                    self._native.local_claim(key, rnd, self.local.size - 1 - len(group["views"]))
                self._maybe_reduce(key, rnd)
            else:  # COORDINATE: hand the owner a shared copy
                owner = self.local.owner(op.tkey, i)
                desc = self._stage(key, data)
                self._send_local(owner, wire.pack(Cmd.LOCAL_READY, sender=self.control.node_id, key=key, round=rnd,
                                                  length=length, dtype=op.dtype, arg=self.cfg.local_rank,
                                                  flags=wire.FLAG_SHM | self._join_epoch_flag()), desc)
                self._awaiting_done[(key, rnd)] = (op, off, length)
                op.servers[("local rank", owner)] += 1

    # ---------------------------------------------------------------- topology executor ranges

    def _declared_kind(self, op):
        """The operation a declaration names; topology ops add their cut into ranges, so workers
        that would cut a tensor differently get the scheduler's mismatch error (core/local_exec.py)."""
        if self._local_exec is not None and self._local_exec.owns(op):
            return self._local_exec.kind(op)
        return KINDS[op.cmd]

    def _dispatch_range(self, rop):
        """Send a RangeOp's partitions (the placement's pieces of the range) through the native core
        (which encodes them where the range has a wire compressor)."""
        parts = self.placement.partitions(rop.place_key, rop.buf.nbytes, dtypes.itemsize(rop.dtype))
        if max(p[0] for p in parts) >> 16:
            rop.fail(BytePSError(f"push_pull of tensor {rop.name!r}: a range of {rop.buf.nbytes} bytes has "
                                 f"{len(parts)} partitions, more than its wire keys can number"))
            return
        self._native_submit_range(rop, parts)

    def _native_submit_range(self, rop, parts):
        """A RangeOp on the native core: a table per range, size and place in the executor's arena (a
        colocated server reads the arena itself: the staging region is the range's own memory)."""
        ident = ("range", rop.tkey, rop.range_index, rop.buf.nbytes, rop.dtype, rop.shared,
                 self._codec_ident(rop.codec))
        entry = self._native_parts.get(ident)
        if entry is None:
            ids = self._memberships[-1]["ids"]  # placement positions -> the job's server indices
            rows = np.zeros((len(parts), 12), dtype=np.int64)
            rows[:, 9] = -1
            base_addr = rop.buf.ctypes.data if len(parts) else 0
            for row, (j, off, length, at) in enumerate(parts):
                server = ids[at]
                key = wire.make_key(rop.tkey, rop.range_index << 16 | j)
                rows[row, :4] = (key, off, length, server)
                rows[row, 11] = self._compresses(rop.codec, rop.dtype, rop.buf.nbytes, length, server)
                if self.colocated[server] and length:
                    if rop.shared is not None:
                        pid, fd, inode, base = rop.shared
                        rows[row, 4:9] = (base_addr + off, pid, fd, inode, base + off)
                    else:
                        view, desc = self._region(key, length)
                        rows[row, 4:9] = (view.ctypes.data, *desc)
            with self._native_lock:
                table = self._native.add_table(rop.name, rows, self._codec_settings(rop.codec))
                entry = self._native_parts[ident] = (table, len(parts))
        table, count = entry
        if not count:
            rop._finish()
            return
        nid = next(self._native_ids)
        rop.parts_left = count
        self._native_ops[nid] = rop
        self._native.submit(nid, table, Cmd.PUSHPULL, rop.dtype, 0, rop.priority, False, rop.buf)
        self.native_submitted += 1
        rop.native_id = nid

    def stages_of(self, op, i, server):
        """The ordered stages of partition ``i`` of ``op`` on this process (core/stages.py)."""
        kind = KINDS[op.cmd]
        local = self.local is not None and op.pset is None  # a process set's members push themselves
        owner = not local or self.local.owns(op.tkey, i)
        ident = (owner, self.colocated[server], kind, local)
        got = self._stage_lists.get(ident)
        if got is None:
            got = self._stage_lists[ident] = stages.stage_list(
                owner=owner, local_size=self.cfg.local_size, local_reduce=local,
                colocated=self.colocated[server] and not (op.cmd == Cmd.BROADCAST and op.root != self.rank),
                kind=kind, machines=self.cfg.num_worker)
            logger.info("pipeline of a %s partition (%s, %s server): %s", kind, "owner" if owner else "not owner",
                        "colocated" if ident[1] else "remote", stages.describe(got))
        return got

    def _stage_async(self, op, key, rnd, server, off, data):
        """STAGE on the copy thread: copy the partition into shared memory, then PUSH (_on_staged)."""
        view, prefix = self._region(key, data.size)

        def stage():
            copy_into(view, data, stream=True)  # the server reads it on another core
        stage.ident = (op, key, rnd, server, off, view, prefix)
        op.servers["the copy stage"] += 1
        self._copier.submit(op.priority, stage)

    def _on_staged(self, fn, error):
        op, key, rnd, server, off, view, prefix = fn.ident
        op.servers["the copy stage"] -= 1
        if error is not None or op.error is not None:
            self._sendq.release(view.size, op.priority, key)
            op.error = op.error or BytePSError(f"tensor {op.name!r}: copy into shared memory failed: {error}")
            self._partition_done(op, view.size)
            self._send_ready()
            return
        self._push(op, key, rnd, server, off, view, shared=prefix)

    def _push(self, op, key, rnd, server, off, data, shared=None):
        """Send one partition to its server; ``shared`` is the descriptor prefix if data is in our arena."""
        self._parts[(key, rnd)] = (op, off, data.size)
        op.servers[("server", server)] += 1
        flags = 0
        if op.cmd == Cmd.BROADCAST and op.root != self.rank:
            body = b""
        elif self.colocated[server]:
            # the server sums straight from our shared copy
            body = shm.describe(shared, data.size) if shared is not None else self._stage(key, data)
            flags = wire.FLAG_SHM
        elif op.codec is not None and op.cmd == Cmd.PUSHPULL and op.codec.applies(op.dtype, op.buf.nbytes, data.size):
            # compressed on the wire (byteps/compression.py); the header keeps the dense length. Only a
            # joined process's local reduce comes here: other compressed ops are native
            # (core/pipeline/worker_codec.h)
            body = op.codec.encode(data, op.dtype, key, rnd, self.rank)
            flags = wire.FLAG_COMPRESSED
        else:
            body = data
        nbytes = body.nbytes if hasattr(body, "nbytes") else len(body)
        header = wire.pack(op.cmd, sender=self.control.node_id, key=key, round=rnd,
                           length=data.size if flags & (wire.FLAG_SHM | wire.FLAG_COMPRESSED) else nbytes,
                           dtype=op.dtype, arg=op.root, flags=flags)
        if timeline.recorder is not None:  # PUSH lasts until the reply (_on_data)
            self._push_started[(key, rnd)] = time.monotonic_ns()
        self._send_data(server, header, body)
        self.bytes_sent[server] += len(header) + nbytes

    def _region(self, key, nbytes):
        """This key's shared staging region: (view, descriptor prefix), allocated once."""
        staged = self._staging.get(key)
        if staged is None or staged[0].size != nbytes:
            with self._native_lock:
                staged = self._staging[key] = self._shm.alloc(nbytes)
        return staged

    def _stage(self, key, data):
        """Copy a partition into this key's shared staging region; return its descriptor."""
        view, prefix = self._region(key, data.size)
        copy_into(view, data, stream=True)  # the server reads it on another core
        return shm.describe(prefix, data.size)

    # ---------------------------------------------------------------- local reduce (core/local.py)

    def _on_local(self, sock, frames):
        """LOCAL_READY (to an owner) or LOCAL_DONE / ERROR (from an owner) on the local ROUTER."""
        if len(frames) != 3:
            logger.warning("dropped a local message with %d frames", len(frames))
            return
        try:
            header = wire.unpack(frames[1])
        except ProtocolError as e:
            logger.warning("dropped a malformed local message: %s", e)
            return
        peer = frames[0]
        if header.cmd in (Cmd.HELLO, Cmd.AUTH):
            self._local_handshake(sock, peer, header, frames[2])
            return
        if not self._gate.allows(peer):
            if peer not in self._gate.refused:
                self._gate.refused.add(peer)
                logger.warning("ignored a local message from an unauthenticated peer %r", peer)
            return
        if header.cmd == Cmd.LINK:  # a higher local rank offers a direct link (_open_local_links)
            try:
                offer = wire.decode(frames[2])
                self._link_offers[int(offer["local_rank"])] = (int(offer["port"]), bytes.fromhex(offer["token"]), peer,
                                                               offer.get("ring"))
            except (ProtocolError, KeyError, TypeError, ValueError) as e:
                logger.warning("dropped a malformed local link offer: %s", e)
            return
        ident = (header.key, header.round)
        if header.cmd == Cmd.LOCAL_READY:
            try:
                view = self._maps.view(frames[2])
            except ProtocolError as e:
                view = e
            group = self._groups.get(ident)
            if group is not None:
                group["views"].append(view)
                self._maybe_reduce(*ident)
                return
            self._early[ident].append(view)
            self._early_meta.setdefault(ident, (header.dtype, header.length))
            if bool(header.flags & wire.FLAG_JOIN_EPOCH) != bool(self._joins_ended & 1):
                self._early_next.add(ident)  # the peer heard a join end that we have not: for our next op
            elif self.rank in self.joined:
                self._adopt(*ident)
            return
        entry = self._awaiting_done.pop(ident, None)
        if entry is None:  # the op timed out or failed already
            return
        op, off, length = entry
        op.servers[("local rank", header.arg)] -= 1
        if header.cmd == Cmd.LOCAL_DONE:
            try:
                copy_into(op.buf[off:off + length], self._maps.view(frames[2]), stream=True)
            except (ProtocolError, ValueError) as e:
                op.error = op.error or ProtocolError(f"tensor {op.name!r}: local result unreadable: {e}")
        else:
            op.error = op.error or TensorMismatchError(
                f"push_pull of tensor {op.name!r} failed: {wire.decode(frames[2]).get('error', 'unknown error')}")
        self._partition_done(op, length)

    def _local_handshake(self, sock, peer, header, raw):
        if self._gate.secret is None:
            return
        try:
            body = wire.decode(raw)
        except ProtocolError:
            body = {}
        if header.cmd == Cmd.HELLO:
            reply = wire.control(Cmd.CHALLENGE, self.control.node_id, self._gate.challenge(peer, body))
            if self._native_local:  # the native thread owns our ROUTER now
                self._native.send(_worker_core.TO_ROUTER, reply[0], reply[1], ident=peer)
            else:
                sock.send_multipart([peer] + reply)
        elif not self._gate.check(peer, body.get("mac")):
            logger.warning("refused local peer %r: authentication failed", peer)
        elif self._native_local:
            self._native.allow_local(peer)

    def _maybe_reduce(self, key, rnd):
        """LOCAL_REDUCE once every local rank's copy of this partition is in."""
        group = self._groups[(key, rnd)]
        if group.get("reducing") or len(group["views"]) < self._local_copies_expected():
            return
        group["reducing"] = True
        op, off = group["op"], group["off"]
        # partitions differ in length (byteps/placement.py); an adopted one (join()) is its whole op
        length = group.get("len", op.buf.nbytes - off)
        bad = [v for v in group["views"] if isinstance(v, Exception)]
        if bad:
            self._groups.pop((key, rnd))
            op.error = op.error or ProtocolError(f"tensor {op.name!r}: a local rank's shared copy: {bad[0]}")
            self._finish_local(key, rnd, op, length, error=str(op.error))
            return
        dst, prefix = self._region(key, length)
        # a joined owner adds nothing of its own (zeros); an empty sum stays the zeros of a fresh region
        srcs = [*([] if group.get("joined") else [op.buf[off:off + length]]), *group["views"]]
        if not srcs:
            srcs = [op.buf[off:off + length]]

        def reduce():
            sum_many(dst, srcs, op.dtype)
        reduce.ident, reduce.dst, reduce.prefix = (key, rnd), dst, prefix
        if length >= STAGE_THREAD_MIN_BYTES:
            self._compute.submit(op.priority, reduce)
            return
        try:  # a small partition: handing it to the reduce thread costs more than summing it here
            reduce()
            self._compute.done.append((reduce, None))
        except Exception as e:  # reported on the op, as the thread would
            self._compute.done.append((reduce, e))

    def _join_epoch_flag(self):
        return wire.FLAG_JOIN_EPOCH if self._joins_ended & 1 else 0

    def _local_copies_expected(self):
        """How many local ranks send an owner their copy: the others, less those in join()."""
        if self._expected_for is not self.joined:
            self._expected_for = self.joined
            self._expected_copies = sum(1 for w in self.local.peers
                                        if w["rank"] != self.rank and w["rank"] not in self.joined)
        return self._expected_copies

    def _adopt(self, key, rnd):
        """A joined process owns a partition its local peers still reduce: it reduces their copies
        (adding nothing of its own), pushes the sum and hands the result back, as for its own ops."""
        views = self._early.pop((key, rnd), [])
        dtype, nbytes = self._early_meta.pop((key, rnd))
        tkey, part = wire.split_key(key)
        op = Op(f"join.{tkey}.{part}", aligned_empty(nbytes), dtype, (nbytes // dtypes.itemsize(dtype),))
        op.tkey, op.parts_left = tkey, 1
        self._groups[(key, rnd)] = {"op": op, "i": part, "off": 0, "views": views, "joined": True}
        self._maybe_reduce(key, rnd)

    def _reduce_owed(self, key, rnd, dtype, nbytes):
        """In join(): a local peer sent its copy of a partition this process owns. The native core
        reduces the peers' copies (adding nothing of ours), pushes the sum and hands the result back,
        as for our own ops; we give it the partition's one-row table (server, shared region)."""
        tkey, part = wire.split_key(key)
        ident = ("owed", key, nbytes, dtype)
        entry = self._native_parts.get(ident)
        if entry is None:
            server = self.placement.server(tkey, part)
            rows = np.zeros((1, 11), dtype=np.int64)
            view, desc = self._region(key, nbytes)
            rows[0] = (key, 0, nbytes, server, view.ctypes.data, *desc, self.cfg.local_rank, self.colocated[server])
            with self._native_lock:
                entry = self._native_parts[ident] = (self._native.add_table(f"join.{tkey}.{part}", rows), 1)
        zeros = self._owed_zeros.get(nbytes)
        if zeros is None:  # stands for our copy only if no peer's is usable; never written
            zeros = self._owed_zeros[nbytes] = np.zeros(nbytes, np.uint8)
        op = Op(f"join.{tkey}.{part}", zeros, dtype, (nbytes // dtypes.itemsize(dtype),))
        op.tkey, op.parts_left = tkey, 1
        nid = next(self._native_ids)
        self._native_ops[nid] = op
        self._native.submit_owed(nid, entry[0], rnd, dtype, zeros)
        op.native_id = nid

    def _on_reduced(self, fn, error):
        """PUSH the machine's sum (from the owner's shared region) once the compute stage has it."""
        key, rnd = fn.ident
        group = self._groups[(key, rnd)]
        op = group["op"]
        if error is not None or op.error is not None:
            self._groups.pop((key, rnd))
            op.error = op.error or BytePSError(f"tensor {op.name!r}: local reduce failed: {error}")
            self._finish_local(key, rnd, op, fn.dst.size, error=str(op.error))
            return
        group["result"] = (fn.dst, fn.prefix)
        i = group["i"]
        if Stage.PUSH not in self.stages_of(op, i, self.placement.server(op.tkey, i)):
            # one worker machine: its sum is the job's; LOCAL_BROADCAST it at once (core/stages.py)
            self._groups.pop((key, rnd))
            length = fn.dst.size
            if not group.get("joined"):
                copy_into(op.buf[group["off"]:group["off"] + length], fn.dst, stream=True)
            self._finish_local(key, rnd, op, length, desc=shm.describe(fn.prefix, length))
            return
        task = next(self._task_ids)
        self._tasks[task] = ("reduced", key, rnd, fn.dst.size, op.priority)
        self._sendq.push(op.priority, task, fn.dst.size, tie=key)
        self._send_ready()

    def _push_reduced(self, key, rnd, nbytes, priority):
        group = self._groups.get((key, rnd))
        if group is None:  # the op timed out meanwhile
            self._sendq.release(nbytes, priority, key)
            return
        op, i, off = group["op"], group["i"], group["off"]
        view, prefix = group["result"]
        if op.error is not None:
            self._sendq.release(nbytes, priority, key)
            self._groups.pop((key, rnd))
            self._finish_local(key, rnd, op, view.size, error=str(op.error))
            return
        self._push(op, key, rnd, self.placement.server(op.tkey, i), off, view, shared=prefix)

    def _finish_local(self, key, rnd, op, length, desc=None, error=None):
        """LOCAL_BROADCAST: tell this partition's other local ranks where the result is (or the error)."""
        if error is None:
            header = wire.pack(Cmd.LOCAL_DONE, sender=self.control.node_id, key=key, round=rnd, length=length,
                               arg=self.cfg.local_rank, flags=wire.FLAG_SHM)
            body = desc
        else:
            body = wire.encode({"error": error})
            header = wire.pack(Cmd.ERROR, sender=self.control.node_id, key=key, round=rnd, length=len(body),
                               arg=self.cfg.local_rank)
        for lr in self._local_peers:
            self._send_local(lr, header, body)
        self._partition_done(op, length)

    def _send_local(self, local_rank, header, body):
        """A message to another local rank's ROUTER: through the native thread once it owns the sockets."""
        if self._native_local:
            self._native.send(-2 - local_rank, header, body)
        else:
            self._io[self._local_peers[local_rank]].send_multipart([header, body])

    def _partition_done(self, op, length):
        op.parts_left -= 1
        if op.parts_left == 0:
            op._finish()

    # ---------------------------------------------------------------- receiving

    def _on_data(self, server, frames):
        try:
            header = wire.unpack(frames[0])
        except ProtocolError as e:
            logger.warning("malformed reply from server %d: %s", server, e)
            return
        entry = self._parts.pop((header.key, header.round), None)
        if entry is None:  # the op timed out or failed already
            return
        op, off, length = entry
        pushed = self._push_started.pop((header.key, header.round), 0)
        if pushed and timeline.recorder is not None:
            timeline.span("PUSH", pushed, header.key, header.round, length, server, op.priority)
            pulled = time.monotonic_ns()
        self._sendq.release(length, op.priority, header.key)
        op.servers[("server", server)] -= 1
        group = self._groups.pop((header.key, header.round), None)
        if header.cmd == Cmd.REPLY:
            expect = 0 if op.cmd == Cmd.BROADCAST and op.root == self.rank else length
            # an owner receives into its shared region, which the other local ranks read next
            dst = group["result"][0] if group is not None else op.buf[off:off + expect]
            desc = self._receive(frames, header, op, server, dst, expect, owner=group is not None)
            if pushed and timeline.recorder is not None:
                timeline.span("PULL", pulled, header.key, header.round, length, server, op.priority)
            if group is not None:
                if op.error is None:
                    copy_into(op.buf[off:off + length], dst if desc is None else self._maps.view(desc))
                    desc = desc or shm.describe(group["result"][1], length)
                self._finish_local(header.key, header.round, op, length, desc=desc,
                                   error=None if op.error is None else str(op.error))
                self._send_ready()
                return
        elif header.cmd == Cmd.ERROR:
            body = frames[1] if len(frames) > 1 else b"{}"
            try:
                msg = wire.decode(body).get("error", "unknown error")
            except ProtocolError as e:
                msg = str(e)
            op.error = op.error or TensorMismatchError(f"push_pull of tensor {op.name!r} failed: {msg}")
        else:
            op.error = op.error or ProtocolError(f"unexpected {Cmd(header.cmd).name} from server {server}")
        if group is not None:
            self._finish_local(header.key, header.round, op, length, error=str(op.error))
        else:
            self._partition_done(op, length)
        self._send_ready()

    def _receive(self, frames, header, op, server, dst, expect, owner=False):
        """Take a REPLY's body into ``dst``. With FLAG_SHM an owner gets the server store's descriptor
        back instead (its local ranks copy from the store directly, saving a copy)."""
        if len(frames) < 2:
            op.error = op.error or ProtocolError(f"tensor {op.name!r}: server {server} replied without a body")
            return None
        body = frames[1]
        if header.flags & wire.FLAG_COMPRESSED:  # the sum, encoded (byteps/compression.py)
            return self._receive_compressed(body, header, op, server, dst, expect)
        if header.flags & wire.FLAG_SHM:  # the sum is in the server's shared store
            self.bytes_received[server] += wire.HEADER_SIZE + len(body)
            try:
                src = self._maps.view(body)
            except ProtocolError as e:
                op.error = op.error or e
                return None
            if src.size != expect:
                op.error = op.error or ProtocolError(f"tensor {op.name!r}: server {server} replied {src.size} "
                                                     f"bytes for a partition of {expect}")
                return None
            if owner:
                return body
            copy_into(dst, src, stream=True)  # an owner returned above: dst is this process's tensor
            return None
        got = len(body)  # ZeroMQ's own buffer (core/transport.py): one copy, into the tensor
        if got == expect:
            copy_into(dst, body, stream=not owner)
        self.bytes_received[server] += wire.HEADER_SIZE + got
        if got != expect:
            op.error = op.error or ProtocolError(f"tensor {op.name!r}: server {server} replied {got} bytes for "
                                                 f"a partition of {expect}")
        return None

    def _receive_compressed(self, body, header, op, server, dst, expect):
        """Decode a compressed REPLY straight into ``dst`` (vectorised; byteps/compression.py): a joined
        process's local reduce (core/pipeline/worker_codec.h decodes the native core's)."""
        self.bytes_received[server] += wire.HEADER_SIZE + len(body)
        try:
            info = compression.parse(memoryview(body))
            if header.length != expect or info.nbytes != expect or info.dtype != op.dtype:
                raise ProtocolError(f"it decodes to {info.nbytes} bytes of dtype code {info.dtype}, the partition "
                                    f"is {expect} bytes of {dtypes.name(op.dtype)}")
            compression.decode_into(info, dst.view(dtypes.numpy_view_dtype(op.dtype)))
        except ProtocolError as e:
            op.error = op.error or ProtocolError(f"tensor {op.name!r}: server {server}'s compressed reply: {e}")
        return None

    @staticmethod
    def _discard(sock):
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv_into(bytearray())

    # ---------------------------------------------------------------- timeouts

    def _check_timeouts(self):
        now = time.monotonic()
        limit = self.cfg.timeout
        for op in list(self._outstanding_ops()):
            if now - op.started <= limit:
                continue
            if op.tkey is None:
                who = "the scheduler's answer to its declaration (do all workers use this tensor name?)"
            else:
                late = ", ".join(sorted(" ".join(map(str, s)) if isinstance(s, tuple) else s
                                        for s, n in op.servers.items() if n > 0)) or "its turn to be sent"
                who = (f"{late} (a server waits for every machine's push of this tensor and logs the ranks that "
                       "are late; a local rank waits for its machine's other processes)")
            err = BytePSTimeoutError(f"push_pull of tensor {op.name!r} waited {now - op.started:.0f} s "
                                     f"(BYTEPS_TIMEOUT={limit:g}) for {who}")
            for k in [k for k, v in self._parts.items() if v[0] is op]:
                self._sendq.release(self._parts.pop(k)[2], op.priority, k[0])
            for k in [k for k, v in self._awaiting_done.items() if v[0] is op]:
                del self._awaiting_done[k]
            for k in [k for k, g in self._groups.items() if g["op"] is op]:
                del self._groups[k]
            for waiting in self._declaring.values():
                if op in waiting:
                    waiting.remove(op)
            op.fail(err)
