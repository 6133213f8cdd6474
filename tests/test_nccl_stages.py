"""The NCCL stages (core/pipeline/nccl_stages.h, worker_nccl.h): CUDA push_pulls on a machine of several
GPU processes with BYTEPS_LOCAL_STRATEGY=topology, per partition NCCL_REDUCE onto its root's GPU, the
root's COPYD2H / PUSH / PULL / COPYH2D, NCCL_BROADCAST back.

No GPU is needed: the fake CUDA runtime (tests/fake_cudart/fake_cudart.c) is NCCL too, across the
processes of a machine (a shared-memory segment per communicator, collectives matched by their number
and checked to be the same call, a process that issues in another order deadlocks as on a GPU). Real
scheduler, servers and worker processes; each process has its own fake GPU; every result is read back
as a consumer would (after the op's done event) and compared exactly with a locally computed sum.
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_gpu_native import PART, events, fake_cudart  # noqa: E402,F401  (fake_cudart: a fixture)

#: a machine description with 8 GPUs behind PCIe switches: the plans of 2-4 processes have a GPU each
TOPOLOGY = os.path.join(HERE, "..", "topology", "fixtures", "pcie_only.json")


def run(cluster, fake_cudart, args, machines, local_size, env=None, timeout=120, expect_ok=True):
    c = cluster(machines, 1, local_size=local_size,
                env={"BYTEPS_CUDART": fake_cudart, "BYTEPS_NCCL": fake_cudart, "BYTEPS_PARTITION_BYTES": str(PART),
                     "BYTEPS_LOCAL_STRATEGY": "topology", "BYTEPS_TOPOLOGY_FILE": TOPOLOGY, "FAKE_CUDA_DEVICES": "1",
                     **(env or {})})
    c.run_workers("nccl_sums", args)
    codes, _, _ = c.wait_all(timeout)
    assert codes == [0] * (machines * local_size), c.all_logs()
    res = c.results()
    for rank, r in res.items():
        assert "error" not in r, (rank, r.get("error"), c.all_logs())
        if expect_ok:
            assert not r["value"]["errors"], (rank, r["value"]["errors"], c.all_logs())
    return res


def collectives(log):
    """This process's NCCL calls in issue order: [(call, count, dtype, root)] (the fake's log)."""
    return [(f["call"], f["n"], f["dtype"], f["root"]) for _, ph, what, f in events(log)
            if ph == "call" and what == "nccl" and f["rc"] == "0"]


TENSORS = [{"name": "a", "numel": 5000, "dtype": "float32"}, {"name": "b", "numel": 3000, "dtype": "int32"},
           {"name": "c", "numel": 10, "dtype": "float64"}, {"name": "h", "numel": 4100, "dtype": "float16"},
           {"name": "avg", "numel": 2100, "dtype": "float32", "average": True}]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("machines,local_size", [(1, 2), (1, 3), (2, 2)], ids=["1x2", "1x3", "2x2"])
def test_sums_are_exact_in_any_submission_order(cluster, fake_cudart, machines, local_size):
    """Tensors of 1-5 partitions (float32, int32, float64, float16, an average), three rounds, the
    producer's kernel 100 ms late; local rank 1 submits in the reverse order with reversed priorities.
    Every result exact on every process; every process of a machine issued the same collectives in the
    same order (the coordinator's); only a partition's root copies it off the GPU and back, and on one
    machine a sum needs no copy at all (only the average's); the collectives wait for the producer."""
    res = run(cluster, fake_cudart, {"tensors": TENSORS, "rounds": 3, "kernel_delay_us": 100000}, machines,
              local_size)
    per_machine = {}
    for rank, r in res.items():
        v = r["value"]
        assert v["ok"] and all(v["ok"].values()), (rank, v["ok"])
        assert len(v["ok"]) == 3 * len(TENSORS), (rank, v["ok"])
        assert v["local"]["nccl_stages"] is True, v["local"]
        per_machine.setdefault(rank // local_size, []).append((rank, collectives(v["log"])))
        assert v["gpu"]["collectives"] == 2 * 3 * sum(-(-t["numel"] * (8 if t["dtype"] == "float64" else 2 if
                                                     t["dtype"] == "float16" else 4) // PART) for t in TENSORS)
        assert r["stages"]["nccl_reduce"] == r["stages"]["nccl_broadcast"] == v["gpu"]["collectives"] // 2
        assert v["fake"]["wrong_device"] == 0 and v["fake"]["pageable_copies"] == 0, v["fake"]
        # the copies: a root's partitions only (every other partition stays on the GPU), each off and back once
        roots = r["stages"].get("copyd2h", 0)
        assert r["stages"].get("copyh2d", 0) == roots, (rank, r["stages"])
        if machines == 1:  # one machine: the reduce is the sum; only the average is divided on the host
            assert roots <= 3 * -(-2100 * 4 // PART) and r["stages"].get("push", 0) == 0, (rank, r["stages"])
        else:
            assert 0 < roots < v["gpu"]["collectives"] // 2, (rank, r["stages"])  # a share of the partitions
            assert r["stages"]["push"] == roots, (rank, r["stages"])
    for machine, logs in per_machine.items():
        first = logs[0][1]
        assert first, logs
        for rank, calls in logs[1:]:
            assert calls == first, f"machine {machine}: rank {rank} issued another order than rank {logs[0][0]}"


@pytest.mark.timeout(120)
def test_a_rank_that_never_submits_is_named_and_the_others_fail(cluster, fake_cudart):
    """Local rank 1 of 3 stops submitting tensor "gone" after its first round: the coordinator cannot
    order its reduce and times out naming local rank 1; the machine's NCCL stages stop, and the
    other process's op fails with that reason (none hangs); every op before was exact."""
    specs = [{"name": "ok", "numel": 3000, "dtype": "float32"},
             {"name": "gone", "numel": 3000, "dtype": "float32", "skip": [1], "skip_from": 1}]
    res = run(cluster, fake_cudart, {"tensors": specs, "rounds": 2}, 1, 3, env={"BYTEPS_TIMEOUT": "6"},
              expect_ok=False)
    for rank, r in res.items():
        v = r["value"]
        assert v["ok"].get("ok@0") is True and v["ok"].get("gone@0") is True, (rank, v)
        if rank == 1:
            continue
        # the coordinator's time-out; the other's op failed with it (its own time-out waits 2 s longer)
        assert "waited 6 s (BYTEPS_TIMEOUT" in v["errors"].get("gone@1", "") and \
            "for local rank 1 (NCCL_REDUCE)" in v["errors"]["gone@1"], \
            (rank, v["errors"])
    assert "the NCCL stages of this machine stopped: local rank 0" in res[2]["value"]["errors"]["gone@1"]


def test_build_queries_answer_for_the_libraries_that_load(fake_cudart):
    """cuda_built() / nccl_built() (Horovod's names) say whether the CUDA runtime and NCCL load in this
    process: the fake's, then none."""
    code = "from byteps import build_info as b; print(b.cuda_built(), b.nccl_built())"
    env = dict(os.environ, BYTEPS_CUDART=fake_cudart, BYTEPS_NCCL=fake_cudart)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "22105"], out
    env.update(BYTEPS_CUDART="/nonexistent/libcudart.so", BYTEPS_NCCL="/nonexistent/libnccl.so")
    # only the configured paths are tried (a GPU machine's own libraries would load otherwise)
    code = code.replace("print(", "import byteps.core.gpu as g; "
                                  "g.library_candidates = lambda stem, sonames=(), configured='': [configured]; print(")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "0"], out


def test_stage_lists():
    """The NCCL stages' lists (bps_nccl_stage_list, as bpslaunch --stages prints them)."""
    from byteps.core.stages import Stage as S, nccl_stage_list

    R, B = S.NCCL_REDUCE, S.NCCL_BROADCAST
    assert nccl_stage_list(True, machines=2) == (R, S.COPYD2H, S.PUSH, S.PULL, S.COPYH2D, B)
    assert nccl_stage_list(True, colocated=True, machines=2) == (R, S.COPYD2H, S.STAGE, S.PUSH, S.PULL, S.COPYH2D, B)
    assert nccl_stage_list(False, machines=2) == (R, B)
    assert nccl_stage_list(True, machines=1) == (R, B)
    assert nccl_stage_list(True, machines=1, average=True) == (R, S.COPYD2H, S.COPYH2D, B)


@pytest.mark.timeout(200)
def test_the_timeline_shows_the_stages_overlapping(cluster, fake_cudart, tmp_path):
    """2 machines of 2 processes, one tensor of 32 partitions, copies of 3 ms: every process's timeline
    has a NCCL_REDUCE and a NCCL_BROADCAST span per partition, and at each partition's root a later
    partition is copied off the GPU while an earlier one is pushed (the stages overlap across
    partitions; no whole-tensor phase); exact."""
    from byteps.timeline import report

    trace_path = str(tmp_path / "nccl.trace.json")
    res = run(cluster, fake_cudart, {"tensors": [{"name": "big", "numel": 32 * PART // 4, "dtype": "float32"}],
                                     "copy_delay_us": 3000}, 2, 2, env={"BYTEPS_TIMELINE": trace_path})
    assert all(r["value"]["ok"]["big@0"] for r in res.values())
    trace = report.load(trace_path)
    for pid in {s["pid"] for s in trace.spans if trace.role(s["pid"]) == "worker"}:
        spans = {}
        for s in sorted(trace.spans, key=lambda s: s["ts"]):
            if s["pid"] == pid and s["args"].get("tensor") == "big":
                spans.setdefault((s["name"], s["args"]["partition"]), s)
        for name in ("NCCL_REDUCE", "NCCL_BROADCAST"):
            assert sorted(p for n, p in spans if n == name) == list(range(32)), (pid, name, sorted(spans))
        pushed = sorted(p for n, p in spans if n == "PUSH")
        assert pushed and sorted(p for n, p in spans if n == "COPYD2H") == pushed, (pid, sorted(spans))
        assert any(spans[("COPYD2H", j)]["ts"] < spans[("PUSH", i)]["end"] and
                   spans[("PUSH", i)]["ts"] < spans[("COPYD2H", j)]["end"]
                   for i in pushed for j in pushed if j > i), (pid, sorted(spans))
