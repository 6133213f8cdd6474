"""Bad input across workers: a clear error on every rank naming the tensor, ranks and values; no hang."""
import pytest


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["shape", "dtype", "root"])
def test_mismatch_raises_on_every_rank_and_job_survives(cluster, kind):
    c = cluster(2, 2)
    c.run_workers("mismatch", {"kind": kind})
    codes, scodes, sched = c.wait_all(60)
    assert codes == [0, 0] and scodes == [0, 0] and sched == 0, c.all_logs()
    res = c.results()
    for rank in (0, 1):
        first = res[rank]["value"]["first"]
        assert first.startswith("TensorMismatchError"), first
        assert "'x'" in first or "x" in first.split(":")[1], first
        if kind == "shape":
            assert "rank 0: float32[3]" in first and "rank 1: float32[4]" in first, first
        elif kind == "dtype":
            assert "rank 0: float32[4]" in first and "rank 1: float64[4]" in first, first
        else:
            assert "root" in first and "0" in first and "1" in first, first
        # later push_pulls still work: 1 + 2
        assert res[rank]["value"]["after"] == [3.0] * 5, res[rank]


@pytest.mark.timeout(60)
def test_a_call_one_rank_refused_fails_promptly_on_the_others(cluster):
    """Rank 1 refuses a broadcast before declaring it (its root is out of range), then a push_pull (a
    complex tensor); rank 0, which declared both, gets an error naming rank 1 and the reason within
    seconds each time (BYTEPS_TIMEOUT is 30 s here), and the next unnamed push_pull is exact on both:
    names and declarations stayed in step."""
    c = cluster(2, 1)
    c.run_workers("abandoned_call")
    codes, scodes, sched = c.wait_all(50)
    assert codes == [0, 0] and sched == 0, c.all_logs()
    res = c.results()
    mine = res[1]["value"]["first"]
    assert mine.startswith("ValueError") and "root rank 2" in mine and "outside 0..1" in mine, mine
    theirs = res[0]["value"]
    assert theirs["first"].startswith("TensorMismatchError") and "rank 1 refused the call (ValueError" in theirs["first"] \
        and "outside 0..1" in theirs["first"], theirs
    assert "rank 1 refused the call (UnsupportedTypeError" in theirs["second"] and "complex64" in theirs["second"], theirs
    assert theirs["seconds"] < 10, theirs
    for rank in (0, 1):
        assert res[rank]["value"]["after"] == [3.0] * 5, res[rank]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("machines,local_size", [(2, 1), (1, 2), (2, 2)])
def test_a_refused_call_on_a_used_name_fails_promptly_everywhere(cluster, machines, local_size):
    """Rank 1 refuses calls on names every rank used before (no declaration is made again: the servers'
    rounds are abandoned), on 2 machines, 1 machine of 2 processes (local reduce, no server round) and 2
    machines of 2 (a local owner pushes a peer's refusal; and in a process set of ranks 0 and 1), with
    partitions on 2 servers: every other rank gets an error naming rank 1 and its reason within seconds
    (BYTEPS_TIMEOUT is 30 s), and each name's next calls are exact on every rank."""
    c = cluster(machines, 2, local_size, env={"BYTEPS_PARTITION_BYTES": "4000"})
    c.run_workers("abandoned_warm_call")
    codes, scodes, sched = c.wait_all(80)
    assert codes == [0] * machines * local_size and sched == 0, c.all_logs()
    res = c.results()
    for rank in range(machines * local_size):
        names = [("small", "complex64"), ("big", "complex64"), ("cast", "outside 0..")]
        if machines * local_size >= 4 and rank in (0, 1):  # process set [0, 1]
            names.append(("in_set", "not a member"))
        for name, why in names:
            v = res[rank]["value"][name]
            assert v["warm"] and v["after"] in (True, [True, True]), (rank, name, v)
            if rank == 1:
                assert why in v["refused"] and "rank 1 refused" not in v["refused"], (name, v)
                continue
            assert v["refused"].startswith("TensorMismatchError") and "rank 1 refused the call (" in v["refused"] \
                and why in v["refused"], (rank, name, v)
            assert v["seconds"] < 10, (rank, name, v)


@pytest.mark.timeout(90)
def test_ranks_stalled_in_different_collectives_fail_fast(cluster):
    """A rank that skipped a collective (a barrier meets an allreduce, then a process-set check): the
    scheduler fails both within its 3 s grace, far below BYTEPS_TIMEOUT (30 s here), naming who waits
    where; afterwards barriers and unnamed ops are in step again."""
    c = cluster(2, 1)
    c.run_workers("stalled_collectives")
    codes, scodes, sched = c.wait_all(80)
    assert codes == [0, 0] and sched == 0, c.all_logs()
    res = c.results()
    for rank in (0, 1):
        v = res[rank]["value"]
        for step in ("first", "second"):
            assert "wait in different collectives" in v[step], (rank, step, v[step])
            assert v[f"{step}_s"] < 20, (rank, step, v[f"{step}_s"])
        assert "rank 1 in barrier 'barrier'" in v["first"] and "'allreduce.only_rank0'" in v["first"], v["first"]
        assert "process_set.add_process_set" in v["second"], v["second"]
        assert v["after"] == [3.0, 3.0], v


@pytest.mark.timeout(60)
def test_two_jobs_on_one_host_do_not_collide(cluster):
    specs = [{"name": "same", "shape": [50], "dtype": "int64"}]
    jobs = [cluster(2, 1, subdir=f"job{j}") for j in range(2)]
    for c in jobs:
        c.run_workers("sums", {"tensors": specs, "rounds": 3})
    for c in jobs:
        codes, scodes, sched = c.wait_all(60)
        assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()
    a, b = (c.results()[0]["value"] for c in jobs)
    assert a == b and len(a) == 3  # same seeds, same sums, no cross-talk


@pytest.mark.timeout(60)
def test_urgent_tensor_overtakes_a_large_one_under_credit(cluster):
    # 200 partitions of 1000 bytes with one partition on the wire at a time: the urgent tensor,
    # submitted second, must not wait for the other 199.
    c = cluster(2, 1, env={"BYTEPS_PARTITION_BYTES": "1000", "BYTEPS_SCHEDULING_CREDIT": "1"})
    c.run_workers("priority", {"big": 50000})
    codes, scodes, sched = c.wait_all(60)
    assert codes == [0, 0], c.all_logs()
    for rank, res in c.results().items():
        assert res["value"]["order"] == ["small", "big"], res
        assert res["value"]["big_ok"] and res["value"]["small"] == [2.0] * 4, res


#: (machines, processes per machine): plain, and local reduce where joined processes own partitions
JOIN_POINTS = [(3, 1), (1, 3), (2, 2)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("late_end", [False, True], ids=["prompt-end", "late-end"])
@pytest.mark.parametrize("m,l", JOIN_POINTS, ids=[f"{m}x{l}" for m, l in JOIN_POINTS])
def test_join_ranks_contribute_zeros(cluster, m, l, late_end):
    """late-end: every rank but the last hears "every rank joined" 0.5 s late, so the last rank's next op
    sends its local peers copies while they still run join(); they must not add them as a joined rank's."""
    import torch

    c = cluster(m, 2, local_size=l, env={"BYTEPS_PARTITION_BYTES": "4000"})
    c.run_workers("join", {"late_end": late_end})
    codes, scodes, sched = c.wait_all(60)
    n = m * l
    assert codes == [0] * n and scodes == [0, 0] and sched == 0, c.all_logs()
    res = c.results()
    for r in range(n):
        v = res[r]["value"] if "value" in res[r] else pytest.fail(f"rank {r}: {res[r]}\n{c.all_logs()}")
        # step s: the ranks still running are those with r >= s; joined ones add zeros; / full size
        want = [(torch.tensor(float(sum(q + 1 for q in range(s, n)))) / n).item() for s in range(r + 1)]
        assert v["steps"] == want, (r, v["steps"], want)
        assert v["last"] == n - 1, v
        assert v["after"] == sum(q + 1 for q in range(n)), v
    assert "not supported while ranks" in res[n - 1]["value"]["broadcast"], res[n - 1]


@pytest.mark.timeout(120)
def test_edge_inputs(cluster):
    """The docs/bad_input.md rows that need a running job, in one job."""
    c = cluster(2, 2)
    c.run_workers("edge_inputs", {"many": 10000})
    codes, scodes, sched = c.wait_all(100)
    assert codes == [0, 0] and scodes == [0, 0] and sched == 0, c.all_logs()
    for r, res in c.results().items():
        v = res["value"]
        assert v["nan_inf"] == ["nan", "inf", "-inf", "2.0"], v["nan_inf"]  # passed through, never "fixed"
        assert v["many_ok"], "10,000 small tensors in one step summed wrong"
        assert v["resized"] == [6.0, 10.0, 6.0], v["resized"]  # a resized tensor simply gets a new key
        assert "more than one element" in v["overlap"] or "overlap" in v["overlap"].lower(), v["overlap"]
        assert v["after"] == [2.0, 2.0], v


@pytest.mark.timeout(60)
def test_scheduler_port_in_use_is_a_clear_error(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, DMLC_ROLE="scheduler", DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1",
                   DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port))
        p = subprocess.run([sys.executable, "-m", "byteps.scheduler"], env=env, capture_output=True, text=True,
                           timeout=30)
    assert p.returncode == 2, p.stderr
    assert f"127.0.0.1:{port}" in p.stderr and "in use" in p.stderr.lower(), p.stderr
