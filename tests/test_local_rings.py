"""Shared-memory local links (core/transport/bps_link.h BpsShmLink): both ends of one link in this process
(``_worker_core.RingPair``: a real memfd mapped twice and a real socketpair), then whole jobs whose
local links run over rings.

The ring carries the bytes; the socket carries only bells (one byte, when the reader does not poll)
and the peer's EOF. These tests check the byte pipe under BpsLink's framing: order and contents
across wrap-around, a full ring (the writer queues, the reader's bell says when to go on), a frame
larger than the ring, when bells are and are not written, and a peer that goes.
"""
import random

import pytest

from byteps.core import _worker_core

pytestmark = pytest.mark.skipif(not _worker_core.available, reason="the native core needs pyzmq's libzmq "
                                                                   "as a shared object")

RING_BYTES = 128 << 10  # BPS_RING_BYTES: one direction's ring


def drain(pair, end, into):
    """Every whole message waiting at ``end``, appended to ``into``; how many."""
    n = 0
    while True:
        got = pair.recv(end)
        assert got != -1, pair.error(end)
        if got is None:
            return n
        into.append(got)
        n += 1


def test_messages_arrive_whole_and_in_order_through_a_full_ring_and_its_wrap_around():
    """5 MB of messages of random sizes, far more than the ring holds, sent without the reader
    reading: the writer queues what does not fit (wants_write), the reader's reads ring a bell toward
    the writer (the socket has a byte), the writer goes on from its queue when it looks at its end,
    and every message arrives whole and in order."""
    rng = random.Random(7)
    pair = _worker_core.RingPair()
    sent = []
    for i in range(2000):
        head = i.to_bytes(8, "little")
        body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64))) * rng.randrange(1, 80)
        sent.append([head, body])
        assert pair.send(0, head, body) == 0
    assert pair.wants_write(0), "5 MB should not fit in a 128 KB ring"
    got, room_bells = [], 0
    for _ in range(100000):
        if len(got) == len(sent):
            break
        drain(pair, 1, got)
        room_bells += pair.socket_bytes(0) > 0
        pair.recv(0)  # the writer looks at its end: drains the bell, goes on with its queue
    assert len(got) == len(sent)
    assert got == sent
    assert room_bells > 0, "the reader never told the waiting writer that the ring had room"
    assert not pair.wants_write(0)


def test_a_frame_larger_than_the_ring_goes_through_in_pieces():
    """The writer queues what the ring does not take; the reader's first read rings a bell toward
    it (a writer that sleeps in poll has nothing else to go on), and the frame arrives whole."""
    pair = _worker_core.RingPair()
    big = bytes(random.Random(3).getrandbits(8) for _ in range(1 << 16)) * 16  # 1 MB, 8x the ring
    assert pair.send(1, b"header", big) == 0
    assert pair.wants_write(1) and pair.socket_bytes(1) == 0
    assert pair.recv(0) is None  # takes what the ring holds; the frame is not whole yet
    assert pair.socket_bytes(1) == 1, "the reader made room but did not tell the waiting writer"
    got = []
    for _ in range(10000):
        if got:
            break
        drain(pair, 0, got)
        pair.recv(1)
    assert got == [[b"header", big]]


def test_bells_are_written_only_for_a_reader_that_does_not_poll():
    pair = _worker_core.RingPair()
    # not polling: the first message rings, a second one before the reader drained does not ring again
    pair.send(0, b"a", b"1")
    pair.send(0, b"b", b"2")
    assert pair.socket_bytes(1) == 1
    got = []
    assert drain(pair, 1, got) == 2 and got == [[b"a", b"1"], [b"b", b"2"]]
    assert pair.socket_bytes(1) == 0, "the reader drains its bells once the ring is empty"
    # polling: no bell, but the bytes are there (pending_input) and a poll reads them without one
    pair.poll_ring(1, True)
    pair.send(0, b"c", b"3")
    assert pair.socket_bytes(1) == 0
    assert pair.pending_input(1)
    assert pair.recv(1) == [b"c", b"3"]
    # a message that came while polling, unread: arming to sleep says so instead of sleeping on it
    pair.send(0, b"d", b"4")
    assert pair.socket_bytes(1) == 0
    assert pair.arm_to_sleep(1) is True
    assert pair.recv(1) == [b"d", b"4"]
    # armed (no longer polling): the next message rings again
    assert pair.arm_to_sleep(1) is False
    pair.send(0, b"e", b"5")
    assert pair.socket_bytes(1) == 1
    assert pair.recv(1) == [b"e", b"5"] and pair.recv(1) is None


def test_a_polling_writer_rings_only_if_its_peer_has_not_read_when_it_stops():
    """A direct caller polls its end while it waits for its answer: what it writes meanwhile rings no
    bell then, but when it stops polling (to sleep, or done) if the peer has not read it yet."""
    pair = _worker_core.RingPair()
    pair.poll_ring(0, True)
    pair.send(0, b"ready", b"1")
    assert pair.socket_bytes(1) == 0
    assert pair.recv(1) == [b"ready", b"1"]  # the peer's direct caller read it without a bell
    pair.poll_ring(0, False)
    assert pair.socket_bytes(1) == 0, "read already: no bell"

    pair.poll_ring(0, True)
    pair.send(0, b"ready", b"2")
    assert pair.socket_bytes(1) == 0
    assert pair.arm_to_sleep(0) is False  # the writer goes to sleep: the peer (asleep too) gets its bell
    assert pair.socket_bytes(1) == 1
    assert pair.recv(1) == [b"ready", b"2"]


def test_a_peer_that_goes_is_seen_after_what_it_sent():
    """The messages a peer wrote before it went are still read, then the link is dead ("closed by
    the peer"); sending toward a closed peer fails instead of filling a ring nobody reads."""
    pair = _worker_core.RingPair()
    pair.send(0, b"last", b"words")
    pair.close(0)
    assert pair.recv(1) == [b"last", b"words"]
    assert pair.recv(1) == -1
    assert pair.dead(1) and pair.error(1) == "closed by the peer"

    pair = _worker_core.RingPair()
    pair.close(1)
    assert pair.send(0, b"to", b"nobody") == -1
    assert pair.dead(0) and "Broken pipe" in pair.error(0)
