"""Local links (core/pipeline/bps_worker.h, "Local links"): a machine's worker processes send each other the
local reduce's messages over direct links that byteps-net reads and writes, not ZeroMQ: shared-memory
rings with a TCP socket for wake-ups (tests/test_local_rings.py tests the rings alone), or the TCP
socket itself where a ring cannot be made.

Every job here is real (scheduler, servers and workers as processes on 127.0.0.1); sums are compared
bit for bit with locally computed ones by test_push_pull.check_matrix.
"""
import os

import pytest

from test_native_core import run_join
from test_push_pull import SMALL_SHAPES, check_matrix


#: one tiny partition, a few inline-summed ones, and 300000-byte partitions summed on the stage thread
SHAPES = SMALL_SHAPES + [(3, 257), (3, 70001)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rings", ["1", "0"], ids=["rings", "tcp-links"])
def test_exact_sums_over_local_links(cluster, rings):
    """1 machine x 2 processes: exact sums; every LOCAL_READY / LOCAL_DONE went over the links (their
    counters), through shared-memory rings unless the test refuses to make them (the pair then stays on
    the link's TCP socket)."""
    res = check_matrix(cluster, 1, 1, SHAPES, rounds=2, extreme=True, local_size=2,
                       extra_env={"BYTEPS_PARTITION_BYTES": "300000", "TEST_NO_LOCAL_RINGS": str(1 - int(rings))})
    stats = [res[r]["native_local"] for r in range(2)]
    assert all(s is not None and s["reduced"] > 0 and s["coordinated"] > 0 for s in stats), stats
    for s in stats:
        assert s["links_up"] == 1 and s["rings_up"] == int(rings), stats
        # each partition's non-owner sends one LOCAL_READY and gets one LOCAL_DONE: all on links
        assert s["link_sent"] >= s["coordinated"] + s["reduced"] and s["link_received"] > 0, stats
    assert sum(s["link_sent"] for s in stats) == sum(s["link_received"] for s in stats), stats


@pytest.mark.timeout(300)
def test_local_links_between_four_processes_with_two_machines(cluster):
    """2 machines x 2 processes, and 1 machine x 4 (each process links to every other local rank)."""
    res = check_matrix(cluster, 2, 2, SHAPES, rounds=2, extreme=False, ipc=False, local_size=2,
                       extra_env={"BYTEPS_PARTITION_BYTES": "300000"})
    for r in range(4):
        s = res[r]["native_local"]
        assert s["links_up"] == 1 and s["rings_up"] == 1 and s["link_sent"] > 0 and s["link_received"] > 0, (r, s)
    # BYTEPS_CPU_BIND=auto counts the job's worker processes on this host (both machines here): with at most
    # 4 CPUs each of the 4 is bound to one, the same number on every CPU
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) <= 4:
        bound = [res[r]["cpus"] for r in range(4)]
        assert all(len(c) == 1 for c in bound), bound
        per_cpu = [sum(c == [u] for c in bound) for u in usable]
        assert max(per_cpu) - min(per_cpu) <= 1, (bound, usable)

    def make(*a, **kw):
        return cluster(*a, subdir="1x4", **kw)
    res = check_matrix(make, 1, 1, SHAPES, rounds=2, extreme=False, local_size=4,
                       extra_env={"BYTEPS_PARTITION_BYTES": "300000"})
    for r in range(4):
        s = res[r]["native_local"]
        assert s["links_up"] == 3 and s["rings_up"] == 3 and s["link_sent"] > 0 and s["link_received"] > 0, (r, s)
    # BYTEPS_CPU_BIND=auto: 4 processes on at most 4 CPUs are bound, local rank r to the r-th CPU; else left alone
    usable = sorted(os.sched_getaffinity(0))
    for r in range(4):
        want = [usable[r % len(usable)]] if len(usable) <= 4 else usable
        assert res[r]["cpus"] == want, (r, res[r]["cpus"], usable)


@pytest.mark.timeout(120)
def test_join_after_native_steps_over_local_links(cluster):
    """join() on a 1x3 machine: Python's local reduce (forwarded messages, Python's sends) runs over the
    links too; results as tests/test_native_core.py's join test."""
    res = run_join(cluster)
    for r in range(3):
        assert res[r]["native_local"]["links_up"] == 2, res[r]["native_local"]
