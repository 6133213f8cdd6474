"""The worker's native data plane (core/pipeline/bps_worker.h, core/_worker_core.pyx).

Every job here is real (scheduler, servers and workers as processes on 127.0.0.1); sums are compared
bit for bit with locally computed ones by test_push_pull.check_matrix.
"""
import pytest

from test_push_pull import SMALL_SHAPES, check_matrix



@pytest.mark.timeout(200)
@pytest.mark.parametrize("ipc", [True, False], ids=["shm", "tcp"])
def test_exact_sums_through_the_native_engine(cluster, ipc):
    """Every dtype and shape, partitions below and above the zero-copy size, through shared memory
    and TCP; the native path really ran."""
    res = check_matrix(cluster, 2, 2, SMALL_SHAPES + [(3, 70001)], rounds=2, extreme=False, ipc=ipc,
                       extra_env={"BYTEPS_PARTITION_BYTES": "300000"})
    for r, v in res.items():
        assert v["native_ops"] > 0, (r, v["native_ops"])



@pytest.mark.timeout(120)
def test_poll_never_reports_done_before_the_sum(cluster):
    """poll() right after starting a new tensor: done only once the sum is in the tensor (a native op's
    id must not be visible before the native core holds the op, which reads unknown ids as finished)."""
    c = cluster(2, 1)
    c.run_workers("poll_race", {"ops": 150, "elems": 3000})
    codes, scodes, sched = c.wait_all(90)
    assert codes == [0, 0], c.all_logs()
    for r, v in c.results().items():
        assert v["value"]["early"] == [], (r, v["value"])
        assert v["native_ops"] >= 150, (r, v["native_ops"])


# The native local reduce: a machine's processes (L > 1) sum in the native core (COORDINATE, LOCAL_REDUCE
# on the stage thread or inline, PUSH/PULL, LOCAL_BROADCAST) with core/local.py's protocol.
#: partitions of 300000 bytes: float32 (3, 70001) and (200000,) are 3 partitions summed on the stage
#: thread (>= 256 KB), int8 (3, 70001) one partition summed inline, SMALL_SHAPES one or a few tiny ones
LOCAL_SHAPES = SMALL_SHAPES + [(3, 257), (3, 70001), (200000,)]
LOCAL_NATIVE_POINTS = [(1, 2), (1, 4), (2, 2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("m,l", LOCAL_NATIVE_POINTS, ids=[f"{m}x{l}" for m, l in LOCAL_NATIVE_POINTS])
def test_local_reduce_native_is_exact(cluster, m, l):
    """Every dtype (fp16/bf16 and ints included), 1 to many partitions, above and below the inline-sum
    size, 2 rounds: exact against the ground truth computed locally (check_matrix); the native local
    path really ran (its counters)."""
    env = {"BYTEPS_PARTITION_BYTES": "300000", "PARTITION_BYTES_NOTE": "see LOCAL_SHAPES"}
    runs = check_matrix(cluster, m, 1, LOCAL_SHAPES, rounds=2, extreme=True, ipc=m == 1, local_size=l, extra_env=env)
    n = m * l
    stats = [runs[r]["native_local"] for r in range(n)]
    assert all(s is not None and s["ops"] > 0 and s["reduced"] > 0 and s["coordinated"] > 0 for s in stats), stats
    assert sum(s["reduced_on_thread"] for s in stats) > 0, stats  # big partitions were summed off the network thread
    # one worker machine: its local sum is the job's, no partition goes to a server (core/stages.py); with
    # two machines the owners push
    sent = [runs[r]["data_sent"] for r in range(n)]
    assert (sum(sent) == 0) == (m == 1), sent
    # every partition went through its stage list, one step() at a time (byteps.metrics()): per machine
    # one owner (LOCAL_REDUCE, the server round trip unless its machine is the job, LOCAL_BROADCAST) and
    # l - 1 others (COORDINATE, LOCAL_BROADCAST)
    st = [runs[r]["stages"] for r in range(n)]
    reduced = sum(s.get("local_reduce", 0) for s in st)
    assert reduced > 0 and sum(s.get("coordinate", 0) for s in st) == (l - 1) * reduced, st
    assert sum(s.get("local_broadcast", 0) for s in st) == l * reduced, st
    assert sum(s.get("push", 0) for s in st) == sum(s.get("pull", 0) for s in st) == (reduced if m > 1 else 0), st
    assert not any(s.get("stage") for s in st), st  # the local reduce's sum is in shared memory already


@pytest.mark.timeout(120)
def test_missing_local_rank_is_named_in_the_time_out(cluster):
    timeout = 8  # also bounds start-up, which takes a few seconds on a loaded 2-core machine
    c = cluster(1, 1, local_size=2, env={"BYTEPS_TIMEOUT": str(timeout), "BYTEPS_PARTITION_BYTES": "4000"})
    c.run_workers("local_rank_missing", {"sleep": 2 * timeout + 6})
    codes, _, _ = c.wait_all(90)
    assert codes == [0, 0], c.all_logs()
    res = c.results()[0]
    got = res["value"]
    for name in ("multi", "one"):
        err = got[name]
        assert err.startswith("BytePSTimeoutError") and f"tensor {name!r}" in err and "local rank 1" in err, err
        assert f"BYTEPS_TIMEOUT={timeout}" in err and "a local rank waits for its machine's other processes" in err, err
    assert got["one"].startswith("BytePSTimeoutError"), got
    assert res["native_local"] is not None, res


@pytest.mark.timeout(120)
def test_local_reduce_urgent_tensor_overtakes_under_credit(cluster):
    """2x2 machines, one 1000-byte partition on the wire at a time: the owners' pushes of the machines'
    sums queue by priority, so the urgent tensor submitted second does not wait for 200 partitions.
    (One machine alone pushes nothing: its local sum is the result, core/stages.py.)"""
    c = cluster(2, 1, local_size=2, env={"BYTEPS_PARTITION_BYTES": "1000", "BYTEPS_SCHEDULING_CREDIT": "1"})
    c.run_workers("priority", {"big": 50000})
    codes, _, _ = c.wait_all(90)
    assert codes == [0] * 4, c.all_logs()
    for rank, res in c.results().items():
        assert res["value"]["order"] == ["small", "big"], res
        assert res["value"]["big_ok"] and res["value"]["small"] == [4.0] * 4, res
        assert res["native_local"]["ops"] >= 2 and res["native_local"]["reduced"] > 0, res["native_local"]


@pytest.mark.timeout(120)
def run_join(cluster):
    """The ``join`` scenario on a 1x3 machine, every rank's results checked exactly; the results."""
    import torch

    c = cluster(1, 2, local_size=3, env={"BYTEPS_PARTITION_BYTES": "4000"})
    c.run_workers("join")
    codes, _, _ = c.wait_all(60)
    assert codes == [0, 0, 0], c.all_logs()
    res = c.results()
    n = 3
    for r in range(n):
        assert "value" in res[r], (r, res[r], c.all_logs())
        v = res[r]["value"]
        want = [(torch.tensor(float(sum(q + 1 for q in range(s, n)))) / n).item() for s in range(r + 1)]
        assert v["steps"] == want and v["last"] == n - 1, (r, v)
        assert v["after"] == sum(q + 1 for q in range(n)), v
    return res


def test_joined_processes_reduce_for_their_peers_natively(cluster):
    """join() on a 1x3 machine: rank r runs r + 1 steps natively, also while ranks below it have joined.
    A joined process owns partitions of its peers' later steps and its native core reduces them, adding
    nothing of its own: exactly the partitions it owns (counted from its own ops) times the steps its
    peers ran after it joined; no partition goes through Python. Results as
    test_bad_input.test_join_ranks_contribute_zeros."""
    res = run_join(cluster)
    n = 3
    stats = [res[r]["native_local"] for r in range(n)]
    for r in range(n):
        assert stats[r]["ops"] >= r + 1, (r, stats)
        own_ops = r + 2  # its r + 1 steps and the allreduce after join()
        owned, rest = divmod(stats[r]["reduced"] - stats[r]["for_peers"], own_ops)
        assert rest == 0, (r, stats)
        assert stats[r]["for_peers"] == owned * (n - 1 - r), (r, stats)  # one round per step run after it joined
    assert sum(s["for_peers"] for s in stats) > 0, stats  # some joined rank owned partitions of later steps


@pytest.mark.timeout(120)
def test_completions_are_left_to_the_caller_then_delivered(cluster):
    """A native op that completes is finished by its caller's poll()/synchronize(), not by the completion
    thread taking the GIL from it (bench/bench_gil.py); one nobody takes is finished by the completion
    thread after BPS_LAZY_DELIVERY_S (its event set, its name out of flight); one with a done callback
    (when_done, as DDP hooks use) is delivered at once, not late; so is one the engine thread submits
    after declaring its name, whose caller may be waiting on its event already."""
    c = cluster(2, 1)
    c.run_workers("lazy_delivery", {"polled": 20})
    codes, _, _ = c.wait_all(90)
    assert codes == [0, 0], c.all_logs()
    for r, res in c.results().items():
        v = res["value"]
        assert v["sums_ok"] and v["alone"] and v["callback"], (r, v)
        assert v["late_alone"] == 1 and v["late_declared"] == 0, (r, v)
        if r < len(c.results()) - 1:  # their peer came 0.3 s late: prompt() came first, whatever the load
            assert v["late_callback"] == 0, (r, v)
        # the caller takes an op within 50 ms of its completion unless this machine stalls it longer
        assert v["by_caller"] >= 15 and v["late_polled"] <= 20 - v["by_caller"], (r, v)
