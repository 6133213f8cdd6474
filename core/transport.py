"""Data-plane message I/O: whole messages in one call (core/_transport.pyx), and direct links' handshake.

The worker's engine and the server take every data-plane message that reaches Python whole with
``wrap(sock).recv_multipart()`` (None when nothing is queued; it never blocks) and send small
messages with ``send_multipart(frames)``. The Cython module calls libzmq directly, several times
cheaper than pyzmq's calls per message (docs/benchmarks.md, "Per-partition overhead"). The native
cores call the same libzmq, so a pyzmq whose libzmq is not a separate shared library cannot run
byteps: :func:`wrap` says why. Frames below :data:`COPY_BELOW` bytes arrive as ``bytes``; larger
ones as zero-copy frames that support ``len()`` and the buffer protocol.
"""
import socket
import struct

from byteps.errors import BytePSError, ProtocolError

from . import _transport, wire

#: frames smaller than this are copied (ZeroMQ copies small messages anyway; pyzmq's threshold too)
COPY_BELOW = 65536


def wrap(sock, copy_below=COPY_BELOW):
    """Message I/O for ``sock`` (a pyzmq socket used by one thread only), through libzmq called from C."""
    if not _transport.available:
        raise BytePSError(f"byteps calls pyzmq's libzmq from C and cannot here: {_transport.unavailable_reason} "
                          "(install a pyzmq wheel, whose libzmq is a separate shared library)")
    return _transport.FastSocket(sock, copy_below)


# ---------------------------------------------------------------- direct links (core/transport/bps_link.h)
# The native threads own a link once it is up; Python only opens it: the LINK request over ZeroMQ,
# then the token on the new TCP socket and the server's answer, in the link's framing.

LINK_MAGIC = 0x4B4C5042  # "BPLK"
_LINK_HEAD = struct.Struct("<II")
TOKEN_BYTES = 16


def link_pack(frames):
    """One message in the link's framing: magic, frame count, each frame's length, the frames."""
    lens = struct.pack(f"<{len(frames)}Q", *(len(f) for f in frames))
    return b"".join([_LINK_HEAD.pack(LINK_MAGIC, len(frames)), lens, *frames])


def link_recv(sock):
    """Read one whole message from a blocking socket (its timeout applies); ProtocolError if malformed."""
    magic, count = _LINK_HEAD.unpack(_read_exactly(sock, _LINK_HEAD.size))
    if magic != LINK_MAGIC or not 1 <= count <= 8:
        raise ProtocolError(f"not a byteps link message (magic {magic:#x}, {count} frames)")
    lens = struct.unpack(f"<{count}Q", _read_exactly(sock, 8 * count))
    if any(n > wire.MAX_CONTROL_BODY for n in lens):
        raise ProtocolError(f"link handshake frame of {max(lens)} bytes")
    return [_read_exactly(sock, n) for n in lens]


def _read_exactly(sock, n):
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("the server closed the link during its handshake")
        buf += got
    return bytes(buf)


def open_link(host, port, token, identity, node_id, timeout, arg=0):
    """Connect a direct link and present ``token`` for ``identity``; the connected socket's fd (now the
    caller's) once the server accepted it. OSError/ProtocolError/ConnectionError if it did not. ``arg``
    goes in the hello's header (a local link: 1 = we mapped the offered shared-memory ring)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(link_pack([wire.pack(wire.Cmd.LINK, sender=node_id, length=TOKEN_BYTES + len(identity),
                                          arg=arg), token + identity]))
        frames = link_recv(sock)
        header = wire.unpack(frames[0])
        if header.cmd != wire.Cmd.LINK or header.arg != 1:
            raise ConnectionError(f"the server refused the link ({wire.Cmd(header.cmd).name}, arg {header.arg})")
        sock.setblocking(False)
        return sock.detach()
    finally:
        sock.close()  # after detach() this closes nothing


def listen_link(host):
    """A listening socket for workers' links on ``host`` (random port): (fd, port); the fd is the caller's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        return sock.detach(), port
    finally:
        sock.close()
