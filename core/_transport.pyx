# cython: language_level=3
"""The data plane's message I/O in C: one call per message instead of one Python call per frame.

A partition's round trip is a handful of small ZeroMQ messages (a 40-byte header, a 32-byte
shared-memory descriptor, a peer identity). Through pyzmq each frame costs a Python-level call,
``getsockopt(RCVMORE)`` / ``getsockopt(EVENTS)`` checks and enum arithmetic: several microseconds
per message, more than the work itself. This module calls libzmq directly:

* :meth:`FastSocket.recv_multipart` takes a whole message without blocking (``None`` if none is
  queued; ZeroMQ delivers a multipart message atomically, so once the first frame is here the
  rest are too). Frames below ``copy_below`` bytes come back as ``bytes``; larger ones as a
  zero-copy :class:`Frame` (the ZeroMQ message buffer itself, exposed through the buffer protocol).
* :meth:`FastSocket.send_multipart` sends a message whose frames are copied into ZeroMQ (what
  pyzmq does below its copy threshold too). Large bodies still go through pyzmq's zero-copy send,
  whose free callback is safe to run on ZeroMQ's I/O thread.

The functions are looked up in the libzmq that pyzmq itself loaded (found in /proc/self/maps), so
both speak to the same sockets and the same library, and nothing is compiled against zmq.h.
Where that library cannot be found (no /proc, a static pyzmq build), :data:`available` is False
and byteps cannot run: core/transport.py and the native cores say why.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uintptr_t
from posix.dlfcn cimport RTLD_NOW, dlopen, dlsym

import os

import zmq

cdef extern from "<errno.h>":
    enum:
        EAGAIN
        EINTR

# libzmq's ABI (zmq.h, 4.x): zmq_msg_t is 64 opaque bytes, pointer aligned
ctypedef struct zmq_msg_t:
    void *_p[8]

ctypedef int (*msg_init_t)(zmq_msg_t *) noexcept nogil
ctypedef int (*msg_recv_t)(zmq_msg_t *, void *, int) noexcept nogil
ctypedef int (*msg_close_t)(zmq_msg_t *) noexcept nogil
ctypedef int (*msg_move_t)(zmq_msg_t *, zmq_msg_t *) noexcept nogil
ctypedef void *(*msg_data_t)(zmq_msg_t *) noexcept nogil
ctypedef size_t (*msg_size_t)(const zmq_msg_t *) noexcept nogil
ctypedef int (*msg_more_t)(const zmq_msg_t *) noexcept nogil
ctypedef int (*send_t)(void *, const void *, size_t, int) noexcept nogil
ctypedef int (*errno_t)() noexcept nogil

cdef enum:
    ZMQ_DONTWAIT = 1
    ZMQ_SNDMORE = 2

cdef msg_init_t _msg_init = NULL
cdef msg_recv_t _msg_recv = NULL
cdef msg_close_t _msg_close = NULL
cdef msg_move_t _msg_move = NULL
cdef msg_data_t _msg_data = NULL
cdef msg_size_t _msg_size = NULL
cdef msg_more_t _msg_more = NULL
cdef send_t _send = NULL
cdef errno_t _errno = NULL

#: True when libzmq's functions were found and this module can be used
available = False
#: why not, when it cannot
unavailable_reason = ""
#: the library file in use
library = None


def _loaded_libzmq():
    """Path of the libzmq shared object pyzmq loaded into this process, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:  # address perms offset dev inode path
                    path = fields[5]
                    if os.path.basename(path).startswith("libzmq") and ".so" in path:
                        return path
    except OSError:
        pass
    return None


cdef int _bind(void *lib) except -1:
    global _msg_init, _msg_recv, _msg_close, _msg_move, _msg_data, _msg_size, _msg_more, _send, _errno
    names = [b"zmq_msg_init", b"zmq_msg_recv", b"zmq_msg_close", b"zmq_msg_move", b"zmq_msg_data",
             b"zmq_msg_size", b"zmq_msg_more", b"zmq_send", b"zmq_errno"]
    cdef void *found[9]
    for i, name in enumerate(names):
        found[i] = dlsym(lib, <const char *>name)
        if found[i] == NULL:
            raise OSError(f"{name.decode()} not found")
    _msg_init = <msg_init_t>found[0]
    _msg_recv = <msg_recv_t>found[1]
    _msg_close = <msg_close_t>found[2]
    _msg_move = <msg_move_t>found[3]
    _msg_data = <msg_data_t>found[4]
    _msg_size = <msg_size_t>found[5]
    _msg_more = <msg_more_t>found[6]
    _send = <send_t>found[7]
    _errno = <errno_t>found[8]
    return 0


def _load():
    global available, unavailable_reason, library
    if zmq.zmq_version_info()[0] != 4:
        unavailable_reason = f"libzmq {zmq.zmq_version()} (this module is written to the 4.x ABI)"
        return
    path = _loaded_libzmq()
    if path is None:
        unavailable_reason = "pyzmq's libzmq is not a separate shared object in /proc/self/maps"
        return
    cdef void *lib = dlopen(path.encode(), RTLD_NOW)  # already loaded: this only takes a reference
    if lib == NULL:
        unavailable_reason = f"dlopen({path}) failed"
        return
    try:
        _bind(lib)
    except OSError as e:
        unavailable_reason = f"{path}: {e}"
        return
    library = path
    available = True


_load()


cdef class Frame:
    """A received ZeroMQ message buffer (no copy); readable and writable through the buffer protocol.

    Mirrors the parts of pyzmq's Frame the engine and server use: ``len()``, ``.buffer``, ``.bytes``.
    """
    cdef zmq_msg_t msg
    cdef Py_ssize_t exports

    def __cinit__(self):
        _msg_init(&self.msg)

    def __dealloc__(self):
        _msg_close(&self.msg)

    def __len__(self):
        return _msg_size(&self.msg)

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, _msg_data(&self.msg), _msg_size(&self.msg), 0, flags)

    @property
    def buffer(self):
        return memoryview(self)

    @property
    def bytes(self):
        return PyBytes_FromStringAndSize(<char *>_msg_data(&self.msg), _msg_size(&self.msg))


cdef class FastSocket:
    """libzmq calls on a pyzmq socket's handle. Use it only from the thread that owns the socket."""
    cdef void *handle
    cdef readonly object sock        # the pyzmq socket: keeps the handle alive, and does zero-copy sends
    cdef public Py_ssize_t copy_below

    def __cinit__(self, sock, Py_ssize_t copy_below=65536):
        if not available:
            raise RuntimeError(f"byteps.core._transport is unavailable: {unavailable_reason}")
        self.sock = sock
        self.handle = <void *><uintptr_t>sock.underlying
        self.copy_below = copy_below

    def recv_multipart(self):
        """The next whole message as a list of frames, or None if none is queued (never blocks)."""
        cdef list frames = []
        cdef zmq_msg_t msg
        cdef int rc, err, flags = ZMQ_DONTWAIT
        cdef size_t size
        cdef Frame frame
        while True:
            _msg_init(&msg)
            rc = _msg_recv(&msg, self.handle, flags)
            if rc < 0:
                err = _errno()
                _msg_close(&msg)
                if err == EINTR:
                    PyErr_CheckSignals()
                    continue
                if err == EAGAIN and not frames:
                    return None
                raise zmq.ZMQError(err)
            size = _msg_size(&msg)
            more = _msg_more(&msg)
            if <Py_ssize_t>size < self.copy_below:
                frames.append(PyBytes_FromStringAndSize(<char *>_msg_data(&msg), size))
                _msg_close(&msg)
            else:
                frame = Frame.__new__(Frame)
                _msg_move(&frame.msg, &msg)
                _msg_close(&msg)
                frames.append(frame)
            if not more:
                return frames
            flags = 0  # the rest of a multipart message is already here

    def send_multipart(self, frames):
        """Send ``frames`` (bytes-like) as one message, copying each into ZeroMQ.

        Waits (without the GIL) only if the socket's high-water mark is reached, as pyzmq's
        blocking send does; raises zmq.ZMQError (e.g. EHOSTUNREACH for a gone ROUTER peer).
        """
        cdef Py_ssize_t i, n = len(frames)
        cdef Py_buffer buf
        cdef int rc, err, flags
        for i in range(n):
            PyObject_GetBuffer(frames[i], &buf, PyBUF_SIMPLE)
            try:
                flags = ZMQ_SNDMORE if i < n - 1 else 0
                while True:
                    rc = _send(self.handle, buf.buf, <size_t>buf.len, flags | ZMQ_DONTWAIT)
                    if rc >= 0:
                        break
                    err = _errno()
                    if err == EAGAIN:  # high-water mark: wait like a blocking send, letting others run
                        with nogil:
                            rc = _send(self.handle, buf.buf, <size_t>buf.len, flags)
                        if rc >= 0:
                            break
                        err = _errno()
                    if err == EINTR:
                        PyErr_CheckSignals()
                        continue
                    raise zmq.ZMQError(err)
            finally:
                PyBuffer_Release(&buf)
