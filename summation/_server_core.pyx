# cython: language_level=3
# distutils: language = c++
"""Python's handle on the server's native data plane (summation/native/bps_server.h).

summation/server.py creates one :class:`ServerCore` once the first address book has arrived and
hands it the data ROUTER socket; the native thread "byteps-serve" then receives, checks, sums and
answers every plain or compressed push without the GIL. Python is called per job or per event, never per
partition:

* :meth:`set_book`, :meth:`set_join`, :meth:`set_pushers`, :meth:`reset` pass the address book, join()
  state, process sets' keys and LEAVE on;
* :meth:`forwarded` returns the messages Python handles (handshakes, strangers, PROBE, LINK,
  malformed messages); :meth:`admit` answers for an identity after a message marked ``auth``;
* :meth:`send` queues Python's replies on the same socket; :meth:`logs` returns warning lines.

:attr:`ServerCore.notify_fd` becomes readable when any of those has something for Python.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdlib cimport free, malloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector

include "byteps/core/native_runtime.pxi"  # available, ucx_load, trace_buffer, ...: this module's copy

cdef extern from "summation/native/bps_server.h" nogil:

    cdef struct bps_zmq_msg:
        void *p[8]

    void *bps_frame_data(bps_zmq_msg *m)
    size_t bps_frame_size(bps_zmq_msg *m)
    void bps_frame_close(bps_zmq_msg *m)

    cdef cppclass BpsMessage:
        int count
        size_t size(int i)
        const unsigned char *data(int i)
        void take(int i, bps_zmq_msg *out)

    cdef cppclass BpsServerForward:
        BpsMessage *msg
        cbool auth

    cdef cppclass BpsServerSend:
        vector[string] frames
        void *zc_data
        size_t zc_len
        int64_t token

    cdef cppclass BpsServerCore:
        BpsServerCore(void *sock, cbool auth_on, cbool shared_stores, int sum_threads, int kernel_threads)
        void start()
        void stop()
        int notify_fd()
        void set_book(int64_t num_workers, int64_t pushers, uint32_t node_id, const vector[uint32_t] &nodes,
                      const vector[int64_t] &ranks)
        void set_join(cbool done, const vector[int64_t] &joined, int64_t active_pushers)
        void set_pushers(uint32_t tensor_key, int64_t members)
        void reset()
        void admit(const string &ident, cbool ok)
        void set_listener(int fd)
        void set_adopt_rounds(cbool on)
        void set_async(cbool on)
        int ucx_listen(const string &host, string *why)
        void expect_link(const string &ident, const string &token)
        uint64_t links_accepted()
        void send(BpsServerSend *m)
        void forwarded(vector[BpsServerForward *] *out)
        void logs(vector[string] *out)
        void released(vector[int64_t] *out)
        uint64_t pushes()
        uint64_t rounds()
        uint64_t forwards()

#: bodies at least this large are sent zero-copy (the caller keeps them alive until released())
ZERO_COPY_MIN = 65536


cdef class NativeFrame:
    """A received ZeroMQ message buffer handed to Python (no copy): ``len()``, the buffer protocol,
    ``.buffer`` and ``.bytes``."""
    cdef bps_zmq_msg *msg

    def __dealloc__(self):
        if self.msg != NULL:
            bps_frame_close(self.msg)
            free(self.msg)
            self.msg = NULL

    def __len__(self):
        return bps_frame_size(self.msg)

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, bps_frame_data(self.msg), bps_frame_size(self.msg), 0, flags)

    @property
    def buffer(self):
        return memoryview(self)

    @property
    def bytes(self):
        return PyBytes_FromStringAndSize(<char *>bps_frame_data(self.msg), bps_frame_size(self.msg))


cdef object _frames(BpsMessage *m):
    cdef int i
    cdef size_t n
    cdef NativeFrame f
    out = []
    for i in range(m.count):
        n = m.size(i)
        if n < ZERO_COPY_MIN:
            out.append(PyBytes_FromStringAndSize(<const char *>m.data(i), n))
        else:
            f = NativeFrame.__new__(NativeFrame)
            f.msg = <bps_zmq_msg *>malloc(sizeof(bps_zmq_msg))
            if f.msg == NULL:
                raise MemoryError()
            m.take(i, f.msg)
            out.append(f)
    return out


cdef class ServerCore:
    cdef BpsServerCore *core
    cdef readonly object socket     # the pyzmq socket handed over (kept alive, never used again by Python)

    def __cinit__(self, sock, bint auth_on, bint shared_stores, int sum_threads, int kernel_threads):
        if not available:
            raise RuntimeError(f"the native server core is unavailable: {unavailable_reason}")
        self.socket = sock
        self.core = new BpsServerCore(<void *><uintptr_t>sock.underlying, auth_on, shared_stores, sum_threads,
                                      kernel_threads)

    def __dealloc__(self):
        if self.core != NULL:
            with nogil:
                self.core.stop()
            del self.core
            self.core = NULL

    def set_async(self, bint on):
        """BYTEPS_ENABLE_ASYNC (before start()): serve asynchronous push_pulls (docs/async.md)."""
        self.core.set_async(on)

    def set_adopt_rounds(self, bint on):
        """Elastic servers (before start()): a key's first push sets its round, so a key taken over
        from a lost server goes on in the round it was in."""
        self.core.set_adopt_rounds(on)

    def set_listener(self, int fd):
        """Hand over a listening TCP socket for workers' direct links (core/transport/bps_link.h), before start();
        the native thread owns the fd from now on and closes it."""
        self.core.set_listener(fd)

    def ucx_listen(self, str host):
        """Listen for workers' UCX endpoints on ``host`` (core/transport/bps_ucx.h), before start(): the port.
        RuntimeError if UCX is not loaded or cannot listen there."""
        cdef string why
        cdef int port = self.core.ucx_listen(host.encode(), &why)
        if port < 0:
            raise RuntimeError(why.decode("utf-8", "replace"))
        return port

    def expect_link(self, bytes ident, bytes token):
        """Admit one direct link from ``ident`` (authenticated) that presents ``token`` (16 bytes)."""
        if len(token) != 16:
            raise ValueError(f"a link token is 16 bytes, not {len(token)}")
        self.core.expect_link(ident, token)

    def start(self):
        self.core.start()

    def stop(self):
        with nogil:
            self.core.stop()

    @property
    def notify_fd(self):
        """An eventfd, readable while forwarded messages, log lines or released tokens wait."""
        return self.core.notify_fd()

    def set_book(self, num_workers, pushers, uint32_t node_id, dict ranks):
        """The address book (``num_workers`` None: no book, as after LEAVE); ranks: {node id: rank}."""
        cdef vector[uint32_t] nodes
        cdef vector[int64_t] values
        for node, rank in ranks.items():
            nodes.push_back(node)
            values.push_back(rank)
        self.core.set_book(-1 if num_workers is None else num_workers, 0 if pushers is None else pushers, node_id,
                           nodes, values)

    def set_join(self, bint done, joined, active_pushers):
        cdef vector[int64_t] ranks
        for r in joined:
            ranks.push_back(r)
        self.core.set_join(done, ranks, 0 if active_pushers is None else active_pushers)

    def set_pushers(self, uint32_t tensor_key, int64_t members):
        """A process set's tensor key: its rounds complete with its ``members``' pushes."""
        self.core.set_pushers(tensor_key, members)

    def reset(self):
        self.core.reset()

    def admit(self, bytes ident, bint ok):
        self.core.admit(ident, ok)

    def send(self, frames, token=None):
        """Queue a message (a list of frames). A last frame of at least ZERO_COPY_MIN bytes with a
        ``token`` is sent zero-copy: keep it alive until :meth:`released` returns the token. Returns
        True if it was."""
        cdef BpsServerSend *m = new BpsServerSend()
        cdef Py_buffer view
        cdef bint zero_copy = False
        cdef Py_ssize_t i, last = len(frames) - 1
        try:
            for i in range(last + 1):
                PyObject_GetBuffer(frames[i], &view, PyBUF_SIMPLE)
                try:
                    if i == last and token is not None and view.len >= ZERO_COPY_MIN:
                        m.zc_data = view.buf
                        m.zc_len = view.len
                        m.token = token
                        zero_copy = True
                    else:
                        m.frames.push_back(string(<char *>view.buf, view.len))
                finally:
                    PyBuffer_Release(&view)
        except BaseException:
            del m
            raise
        self.core.send(m)  # m belongs to the native thread now
        return zero_copy

    def forwarded(self):
        """Messages for Python, in arrival order: [(frames, auth)]."""
        cdef vector[BpsServerForward *] got
        cdef BpsServerForward *f
        self.core.forwarded(&got)
        out = []
        try:
            for f in got:
                out.append((_frames(f.msg), f.auth))
        finally:
            for f in got:
                del f
        return out

    def logs(self):
        cdef vector[string] got
        self.core.logs(&got)
        return [s.decode("utf-8", "surrogateescape") for s in got]

    def released(self):
        cdef vector[int64_t] got
        self.core.released(&got)
        return list(got)

    def stats(self):
        """Counters: pushes handled natively, rounds completed, messages forwarded to Python, direct links
        accepted."""
        return {"pushes": self.core.pushes(), "rounds": self.core.rounds(), "forwarded": self.core.forwards(),
                "links": self.core.links_accepted()}
