"""Unit tier: the pipeline's priority queue and byte credit (deterministic, no processes)."""
import random
import threading
import time

import pytest

from byteps.core._pipeline import PriorityQueue


def drain(q):
    out = []
    while (t := q.pop()) is not None:
        out.append(t)
    return out


def test_priority_then_fifo():
    q = PriorityQueue()
    order = [(0, 1), (3, 2), (0, 3), (3, 4), (-1, 5), (3, 6), (1, 7)]
    for prio, task in order:
        q.push(prio, task)
    assert drain(q) == [2, 4, 6, 7, 1, 3, 5]


def test_matches_a_reference_sort_for_random_input():
    rng = random.Random(7)
    q = PriorityQueue()
    tasks = [(rng.randint(-3, 3), i) for i in range(2000)]
    for prio, i in tasks:
        q.push(prio, i)
    expected = [i for prio, i in sorted(tasks, key=lambda t: (-t[0], t[1]))]
    assert drain(q) == expected


def test_credit_limits_bytes_in_flight():
    q = PriorityQueue(credit=100)
    q.push(0, 1, 60)
    q.push(0, 2, 50)
    q.push(0, 3, 30)
    assert q.pop() == 1 and q.in_flight == 60
    assert q.pop() is None  # 60 + 50 > 100, and FIFO: task 3 must not overtake task 2
    q.release(60)
    assert q.pop() == 2 and q.pop() == 3 and q.in_flight == 80
    q.release(50)
    q.release(30)
    assert q.in_flight == 0


def test_task_larger_than_credit_runs_alone():
    q = PriorityQueue(credit=10)
    q.push(0, 1, 1000)
    q.push(0, 2, 5)
    assert q.pop() == 1
    assert q.pop() is None
    q.release(1000)
    assert q.pop() == 2


def test_urgent_task_is_not_starved_by_a_large_late_one():
    # a large low-priority tensor is queued first; an urgent one arriving later goes first
    q = PriorityQueue(credit=8)
    for i in range(10):
        q.push(0, 100 + i, 4)  # large tensor, 10 partitions
    assert q.pop() == 100 and q.pop() == 101  # credit now full
    q.push(5, 1, 4)  # urgent
    q.release(4)
    assert q.pop() == 1


def test_less_urgent_bytes_do_not_hold_back_a_more_urgent_tensor():
    """The credit counts bytes of the task's priority or a more urgent one (bps_queue.h): with the
    credit full of priority-0 partitions (which other workers may have deferred for the urgent
    tensor, so they may not come back soon), a more urgent tensor still gets a whole credit of its
    own; the lower tensor waits for credit counting everything."""
    q = PriorityQueue(credit=8)
    for i in range(4):
        q.push(0, 100 + i, 4)
    assert q.pop() == 100 and q.pop() == 101 and q.pop() is None  # credit full
    for t in (1, 2, 3):
        q.push(5, t, 4)
    assert q.pop() == 1 and q.pop() == 2  # priority 0's bytes do not count against priority 5
    assert q.pop() is None  # priority 5's own 8 bytes fill its credit: task 3 waits
    q.release(4, 5)
    assert q.pop() == 3
    q.release(4, 5)
    q.release(4, 5)
    q.release(4, 0)
    assert q.pop() == 102 and q.pop() is None  # 0 counts everything: 4 + 4 in flight
    q.release(4, 0)
    assert q.pop() == 103 and q.in_flight == 8


def test_one_priority_is_a_plain_byte_credit():
    q = PriorityQueue(credit=10)
    for i in range(6):
        q.push(3, i, 4)
    assert drain(q) == [0, 1]  # 8 bytes; a third would make 12
    q.release(4, 3)
    assert q.pop() == 2 and q.pop() is None


def test_unlimited_credit():
    q = PriorityQueue(credit=0)
    for i in range(5):
        q.push(0, i, 10 ** 12)
    assert drain(q) == list(range(5))


def test_blocking_pop_wakes_on_push_and_release():
    q = PriorityQueue(credit=10)
    got = []

    def consumer():
        got.append(q.pop(timeout=5))
        got.append(q.pop(timeout=5))

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.05)
    q.push(0, 1, 10)
    time.sleep(0.05)
    q.push(0, 2, 10)  # waits for credit
    time.sleep(0.05)
    assert got == [1]
    q.release(10)
    t.join(5)
    assert got == [1, 2]


def test_pop_times_out_and_close_wakes_waiters():
    q = PriorityQueue()
    start = time.monotonic()
    assert q.pop(timeout=0.1) is None
    assert time.monotonic() - start >= 0.09
    result = []
    t = threading.Thread(target=lambda: result.append(q.pop(timeout=-1)))
    t.start()
    time.sleep(0.05)
    q.close()
    t.join(5)
    assert result == [None] and not t.is_alive()


def test_many_producers_one_consumer_loses_nothing():
    q = PriorityQueue()
    n, producers = 5000, 4

    def produce(base):
        for i in range(n):
            q.push(i % 3, base + i)

    threads = [threading.Thread(target=produce, args=(p * n,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(drain(q)) == list(range(n * producers))


@pytest.mark.parametrize("credit", [0, 1, 5])
def test_len_and_in_flight(credit):
    q = PriorityQueue(credit=credit)
    q.push(0, 1, 3)
    q.push(0, 2, 3)
    assert len(q) == 2
    q.pop()
    assert len(q) == 1 and q.in_flight == 3 and q.credit == credit


# ---------------------------------------------------------------- stage lists (core/stages.py)

def test_stage_lists_per_role():
    from byteps.core.stages import Stage, stage_list

    S = Stage
    assert stage_list(owner=True, local_size=1, local_reduce=False, colocated=False) == (S.PUSH, S.PULL)
    assert stage_list(owner=True, local_size=1, local_reduce=False, colocated=True) == (S.STAGE, S.PUSH, S.PULL)
    assert stage_list(owner=True, local_size=4, local_reduce=True, colocated=True) == \
        (S.LOCAL_REDUCE, S.PUSH, S.PULL, S.LOCAL_BROADCAST)
    assert stage_list(owner=False, local_size=4, local_reduce=True, colocated=True) == \
        (S.COORDINATE, S.LOCAL_BROADCAST)
    # broadcasts never reduce locally
    assert stage_list(owner=False, local_size=4, local_reduce=True, colocated=False, kind="broadcast") == \
        (S.PUSH, S.PULL)
    assert stage_list(owner=True, local_size=1, local_reduce=False, colocated=False, device="cuda") == \
        (S.COPYD2H, S.PUSH, S.PULL, S.COPYH2D)


@pytest.mark.parametrize("raw,needle", [("stage", "must name a stage to drop"), ("-bogus", "unknown stage 'bogus'"),
                                        ("-push", "cannot be dropped")])
def test_pipeline_override_errors(raw, needle):
    from byteps.config import load
    from byteps.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load({"BYTEPS_PIPELINE": raw})


def test_pipeline_override_parses():
    from byteps.core.stages import Stage, parse_override

    assert parse_override("") == set()
    assert parse_override("-stage, -LOCAL_REDUCE") == {Stage.STAGE, Stage.LOCAL_REDUCE}


def test_ties_go_by_tie_not_arrival():
    """Equal priorities: the smaller tie (the send queue's wire key) first, FIFO only among equal ties,
    so two workers that queued x and y in opposite orders pick the same one (bps_queue.h)."""
    for arrival in ([("x", 7), ("y", 3)], [("y", 3), ("x", 7)]):
        q = PriorityQueue()
        for name, tie in arrival:
            q.push(0, ord(name), 4, tie=tie)
        q.push(1, ord("u"), 4, tie=99)  # priority still comes first
        q.push(0, ord("z"), 4, tie=3)   # equal tie: after the earlier arrival
        assert [chr(t) for t in drain(q)] == ["u", "y", "z", "x"]


def test_credit_counts_bytes_at_least_as_urgent_by_tie():
    """A worker whose credit is full of x (tie 7) when y (tie 3, same priority) arrives sends y at once:
    x's bytes are less urgent. The worker that queued y first holds x back behind y, as this one
    would: one order on both, so no worker waits for a push another's credit holds back."""
    q = PriorityQueue(credit=8)
    q.push(0, 1, 8, tie=7)
    assert q.pop() == 1
    q.push(0, 2, 8, tie=7)
    assert q.pop() is None  # x's own 8 bytes fill the credit
    q.push(0, 3, 8, tie=3)
    assert q.pop() == 3  # y is more urgent than everything in flight
    q.push(0, 4, 8, tie=3)
    assert q.pop() is None  # y's 8 bytes in flight now count against y
    q.release(8, 0, 3)
    assert q.pop() == 4 and q.pop() is None
    q.release(8, 0, 3)
    q.release(8, 0, 7)
    assert q.pop() == 2 and q.in_flight == 8


def test_a_stalled_credit_lets_one_task_past():
    """With ``stall``: when nothing was taken or released for that long, the head goes past the credit
    (past_credit reads True), one task per stall; a release ends the stall."""
    q = PriorityQueue(credit=4)
    for t in range(3):
        q.push(0, t, 4, tie=t)
    assert q.pop(stall=0.2) == 0 and not q.past_credit
    assert q.pop(stall=0.2) is None  # not stalled yet
    time.sleep(0.25)
    assert q.pop(stall=0.2) == 1 and q.past_credit and q.in_flight == 8
    assert q.pop(stall=0.2) is None  # the take was progress: the next waits for another stall
    assert q.pop() is None  # and without stall, never
    q.release(4, 0, 0)
    q.release(4, 0, 1)
    assert q.pop(stall=0.2) == 2 and not q.past_credit
