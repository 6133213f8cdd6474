"""The libzmq the native cores call, and direct links' handshake.

ZeroMQ carries the control plane only (Python reads it through pyzmq); the native threads call the
same libzmq that pyzmq loaded, for the control messages they pass on (core/transport/bps_zmq.h), so
a pyzmq whose libzmq is not a separate shared library cannot run byteps: :data:`LIBZMQ_MISSING`
says why. Partitions travel over direct links (below), which the native threads own once Python
has opened them.
"""
import os
import socket
import struct

import zmq

from byteps.errors import ProtocolError

from . import wire


def _loaded_libzmq():
    """(path of the libzmq shared object pyzmq loaded into this process, None), or (None, why not)."""
    if zmq.zmq_version_info()[0] != 4:
        return None, f"libzmq {zmq.zmq_version()} (the native cores are written to the 4.x ABI)"
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()  # address perms offset dev inode path
                if len(fields) >= 6 and os.path.basename(fields[5]).startswith("libzmq") and ".so" in fields[5]:
                    return fields[5], None
    except OSError:
        pass
    return None, ("pyzmq's libzmq is not a separate shared object in /proc/self/maps (install a pyzmq wheel, "
                  "whose libzmq is a separate shared library)")


#: the libzmq the native cores call, or None; and why not
LIBZMQ, LIBZMQ_MISSING = _loaded_libzmq()


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


def link_recv(sock, max_frame=wire.MAX_CONTROL_BODY):
    """Read one whole message from a blocking socket (its timeout applies); ProtocolError if malformed
    or a frame is over ``max_frame`` bytes (a handshake's are small)."""
    magic, count = _LINK_HEAD.unpack(_read_exactly(sock, _LINK_HEAD.size))
    if magic != LINK_MAGIC or not 1 <= count <= 8:
        raise ProtocolError(f"not a byteps link message (magic {magic:#x}, {count} frames)")
    lens = struct.unpack(f"<{count}Q", _read_exactly(sock, 8 * count))
    if any(n > max_frame for n in lens):
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
