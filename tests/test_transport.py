"""core/transport.py: the libzmq the native cores call, and the direct links' framing.

The framing tests run over a real socket pair; the links themselves are tested against real servers in
tests/test_links.py.
"""
import os
import socket
import struct
import threading

import pytest

from byteps.core import transport, wire
from byteps.errors import ProtocolError


def test_the_native_cores_call_the_libzmq_pyzmq_loaded():
    from byteps.core import _worker_core
    from byteps.server import _server_core
    assert transport.LIBZMQ is not None, transport.LIBZMQ_MISSING
    assert os.path.basename(transport.LIBZMQ).startswith("libzmq")
    with open("/proc/self/maps") as f:
        assert transport.LIBZMQ in f.read()
    assert _worker_core.available, _worker_core.unavailable_reason
    assert _server_core.available, _server_core.unavailable_reason


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_link_messages_keep_their_frames_and_boundaries(pair):
    a, b = pair
    messages = [[b"header", b""], [bytes(range(256)) * 4096], [b"x"] * 8]  # empty, 1 MB, the most frames
    sender = threading.Thread(target=lambda: [a.sendall(transport.link_pack(m)) for m in messages])
    sender.start()  # 1 MB is more than the socket pair buffers: it is read while it is written
    got = [transport.link_recv(b) for _ in messages]
    sender.join(5)
    assert got == messages


@pytest.mark.parametrize("raw, why", [
    (struct.pack("<II", 0x12345678, 1) + struct.pack("<Q", 0), "magic 0x12345678"),
    (struct.pack("<II", transport.LINK_MAGIC, 0), "0 frames"),
    (struct.pack("<II", transport.LINK_MAGIC, 9), "9 frames"),
    (struct.pack("<II", transport.LINK_MAGIC, 1) + struct.pack("<Q", wire.MAX_CONTROL_BODY + 1),
     f"frame of {wire.MAX_CONTROL_BODY + 1} bytes"),
])
def test_a_malformed_link_message_is_refused_before_its_body_is_read(pair, raw, why):
    a, b = pair
    a.sendall(raw)
    with pytest.raises(ProtocolError, match=why):
        transport.link_recv(b)


def test_a_link_closed_mid_message_says_so(pair):
    a, b = pair
    a.sendall(transport.link_pack([b"0123456789"])[:-3])
    a.close()
    with pytest.raises(ConnectionError, match="closed the link"):
        transport.link_recv(b)
