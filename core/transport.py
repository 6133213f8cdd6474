"""Data-plane message I/O: whole messages in one call (core/_transport.pyx), or pyzmq as a fallback.

The worker's engine and the server take every data-plane message whole with
``wrap(sock).recv_multipart()`` (None when nothing is queued; it never blocks) and send small
messages with ``send_multipart(frames)``. The Cython module calls libzmq directly: about 1.2-1.5 us
of CPU per small message, sent and received, when a window of 100 messages is in flight, against
10-13 us through pyzmq's calls (0.8 and 5-6 us on a quieter day); that is the calls' cost, not a
latency: one message at a time, echoed back, takes 46-61 us per round trip over loopback TCP
(ZeroMQ's I/O threads and the kernel; 78-92 us through pyzmq). bench/bench_transport.py measures
both; docs/benchmarks.md, "Per-partition overhead". ``BYTEPS_ZMQ_DIRECT=0``, or a pyzmq whose libzmq cannot be found, selects the pyzmq
version of the same interface.

Frames below :data:`COPY_BELOW` bytes arrive as ``bytes``; larger ones as zero-copy frames that
support ``len()`` and the buffer protocol (wrap them in ``memoryview`` for slicing).
"""
import zmq

try:
    from byteps.core import _transport
except ImportError:  # a source tree without build_ext
    _transport = None

_NOBLOCK, _RCVMORE = int(zmq.NOBLOCK), int(zmq.RCVMORE)  # pyzmq's enums cost ~1 us per use
#: frames smaller than this are copied (ZeroMQ copies small messages anyway; pyzmq's threshold too)
COPY_BELOW = 65536


def direct_available():
    """(True, "") if libzmq can be called directly, else (False, why)."""
    if _transport is None:
        return False, "byteps.core._transport is not built"
    return _transport.available, _transport.unavailable_reason


class PyzmqSocket:
    """The interface of ``_transport.FastSocket`` over pyzmq's Python API."""

    def __init__(self, sock, copy_below=COPY_BELOW):
        self.sock = sock
        self.copy_below = copy_below

    def recv_multipart(self):
        try:
            frames = [self.sock.recv(_NOBLOCK)]  # a header or an identity: small
        except zmq.Again:
            return None
        while self.sock.getsockopt(_RCVMORE):
            frame = self.sock.recv(copy=False)
            frames.append(frame.bytes if len(frame) < self.copy_below else frame)
        return frames

    def send_multipart(self, frames):
        self.sock.send_multipart(frames, copy=True)


def wrap(sock, direct=True, copy_below=COPY_BELOW):
    """Message I/O for ``sock`` (a pyzmq socket used by one thread only); ``direct``: BYTEPS_ZMQ_DIRECT."""
    if direct and direct_available()[0]:
        return _transport.FastSocket(sock, copy_below)
    return PyzmqSocket(sock, copy_below)
