"""core/transport.py: whole-message I/O through libzmq called from C (core/_transport.pyx).

Every test runs on real ZeroMQ sockets over loopback TCP.
"""
import threading
import time

import numpy as np
import pytest
import zmq

from byteps.core import transport

def wrap(sock):
    io = transport.wrap(sock)
    assert type(io).__name__ == "FastSocket"
    return io


def connected(ctx, bound_kind, connected_kind, identity=None, **opts):
    """Two sockets over loopback TCP: (bound, connected); ``opts`` are set on both (name: value)."""
    socks = [ctx.socket(bound_kind), ctx.socket(connected_kind)]
    for sock in socks:
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in opts.items():
            sock.setsockopt(getattr(zmq, name), value)
    if identity is not None:
        socks[1].setsockopt(zmq.IDENTITY, identity)
    port = socks[0].bind_to_random_port("tcp://127.0.0.1")
    socks[1].connect(f"tcp://127.0.0.1:{port}")
    return socks


@pytest.fixture
def pair():
    """A connected ROUTER (bound, ROUTER_MANDATORY) and DEALER (identity b"dealer-1")."""
    ctx = zmq.Context()
    router, dealer = connected(ctx, zmq.ROUTER, zmq.DEALER, identity=b"dealer-1")
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    yield router, dealer
    ctx.destroy(linger=0)


def receive(io, timeout=5.0):
    deadline = time.monotonic() + timeout
    while (frames := io.recv_multipart()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no message within {timeout} s")
        time.sleep(0.001)
    return frames


def test_direct_path_is_available_here():
    from byteps.core import _transport
    assert _transport.available, _transport.unavailable_reason


def test_round_trip_small_large_and_empty_frames(pair):
    router, dealer = pair
    r, d = wrap(router), wrap(dealer)
    assert r.recv_multipart() is None  # nothing queued: returns at once
    big = np.arange(transport.COPY_BELOW, dtype=np.uint8)  # exactly the threshold: zero-copy
    d.send_multipart([b"header", b"", bytes(big)])
    frames = receive(r)
    assert frames[:3] == [b"dealer-1", b"header", b""]
    assert all(isinstance(f, bytes) for f in frames[:3])
    assert not isinstance(frames[3], bytes) and len(frames[3]) == big.size
    assert np.array_equal(np.frombuffer(memoryview(frames[3]), dtype=np.uint8), big)
    assert r.recv_multipart() is None
    # the ROUTER answers through its identity frame; just under the threshold is copied to bytes
    r.send_multipart([b"dealer-1", b"reply", bytes(transport.COPY_BELOW - 1)])
    frames = receive(d)
    assert frames[0] == b"reply" and isinstance(frames[1], bytes) and len(frames[1]) == transport.COPY_BELOW - 1


def test_messages_keep_their_order_and_boundaries(pair):
    router, dealer = pair
    r, d = wrap(router), wrap(dealer)
    for i in range(500):
        d.send_multipart([i.to_bytes(4, "little"), bytes([i % 256]) * (i % 7)])
    for i in range(500):
        frames = receive(r)
        assert frames == [b"dealer-1", i.to_bytes(4, "little"), bytes([i % 256]) * (i % 7)]


def test_large_frame_is_zero_copy_writable_and_outlives_its_socket(pair):
    router, dealer = pair
    r = wrap(router)
    payload = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    dealer.send_multipart([b"h", payload])
    frame = receive(r)[2]
    view = np.frombuffer(memoryview(frame), dtype=np.uint8)
    assert np.array_equal(view, payload)
    view[:4] = 7  # ZeroMQ's own buffer, ours until the frame is freed (the server sums from it)
    assert bytes(memoryview(frame)[:4]) == b"\x07" * 4
    router.close()
    assert np.array_equal(np.frombuffer(frame.bytes, dtype=np.uint8)[4:], payload[4:])


def test_unreachable_router_peer_raises_ehostunreach(pair):
    router, _ = pair
    r = wrap(router)
    with pytest.raises(zmq.ZMQError) as err:
        r.send_multipart([b"nobody", b"x"])
    assert err.value.errno == zmq.EHOSTUNREACH


def test_send_at_the_high_water_mark_waits_without_holding_the_gil():
    """A blocked send must let other Python threads run (here: the reader that unblocks it)."""
    ctx = zmq.Context()
    try:
        pull, push = connected(ctx, zmq.PULL, zmq.PUSH, RCVHWM=1, SNDHWM=1)
        p = wrap(push)
        got = []
        started = threading.Event()

        def reader():
            started.set()
            time.sleep(0.3)  # let the sender hit the high-water mark first
            deadline = time.monotonic() + 10
            while len(got) < 200 and time.monotonic() < deadline:
                if pull.poll(100):
                    got.append(pull.recv_multipart())

        t = threading.Thread(target=reader)
        t.start()
        started.wait()
        for i in range(200):
            p.send_multipart([i.to_bytes(4, "little"), bytes(4096)])
        t.join(15)
        assert len(got) == 200 and [int.from_bytes(g[0], "little") for g in got] == list(range(200))
    finally:
        ctx.destroy(linger=0)
