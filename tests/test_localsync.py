"""A machine's local group (topology/localsync.py: memfd arenas and datagram barriers, what the
plan's GPU stages in core/gpu_stages.py stand on) with real processes.

Every local process is a separate ``python tests/topology_worker.py`` (as bpslaunch would start
them: no common parent state), builds the machine's plan itself, writes its input into its arena
and sums every rank's arena between two barriers. Every result is compared with the sum computed
here, exactly (small integers). test_gpu_stages.py runs the GPU stages on the same workers.
"""
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "topology_worker.py")
sys.path.insert(0, HERE)
from topology_worker import inputs  # noqa: E402

#: sizes of successive operations: uneven, smaller than the process count, empty, several partitions
SIZES = [1001, 3, 0, 5000]


def run_local(tmp_path, local_size, cases, mode="sums", timeout=20.0, wall=120):
    """Start ``local_size`` worker processes on ``cases``; return {case name: [record per rank]}."""
    spec = {"mode": mode, "token": uuid.uuid4().hex[:12], "local_size": local_size, "timeout": timeout,
            "cases": cases}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, str(path), str(r), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(local_size)]
    try:
        outs = [p.communicate(timeout=wall)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"local rank {r} exited {p.returncode}:\n{out}"
    records = {}
    for case in cases:
        records[case["name"]] = [json.loads((tmp_path / f"{case['name']}-{r}.json").read_text())
                                 for r in range(local_size)]
    return records


def check_sums(tmp_path, records, case, local_size, offset=0):
    dtype = np.dtype(case.get("dtype", "float32"))
    for r, rec in enumerate(records):
        assert rec["error"] is None, f"{case['name']} local rank {r}: {rec['error']}\n{rec.get('trace')}"
    for op, count in enumerate(case["sizes"]):
        expect = sum(inputs(r, op, count, dtype).astype(np.float64) for r in range(local_size)) + offset
        for r in range(local_size):
            got = np.load(tmp_path / f"{case['name']}-{r}-{op}.npy")
            assert got.dtype == dtype and got.shape == (count,)
            assert np.array_equal(got.astype(np.float64), expect), (
                f"{case['name']} (plan {records[r]['plan']}), operation {op} ({count} elements), local rank {r}: "
                f"first differences at {np.flatnonzero(got != expect)[:5]}")


@pytest.mark.parametrize("local_size", [1, 2, 3, 4])
def test_every_process_derives_the_same_plan_and_sums_exactly(tmp_path, local_size):
    cases = [{"name": "auto", "machine": "cpu_2numa", "sizes": SIZES},  # cpu_assisted over 2 NUMA groups
             {"name": "reduce_broadcast", "machine": "cpu_2numa", "overrides": {"strategy": "reduce_broadcast"},
              "sizes": SIZES, "dtype": "int64"},
             {"name": "reduce_scatter", "machine": "cpu_2numa", "overrides": {"strategy": "reduce_scatter"},
              "sizes": SIZES, "dtype": "float64"}]
    records = run_local(tmp_path, local_size, cases)
    for case in cases:
        recs = records[case["name"]]
        assert all(rec["plan"] == recs[0]["plan"] for rec in recs), "processes derived different plans"
        expected = "none" if local_size == 1 else "cpu_assisted" if case["name"] == "auto" else case["name"]
        assert recs[0]["plan"][0] == expected, recs[0]["plan"]
        check_sums(tmp_path, recs, case, local_size)
    if local_size == 3:  # NUMA grouping of 3 processes is uneven: [0, 1] and [2]
        assert records["auto"][0]["plan"][1] == [[0, 1], [2]]


def test_mismatched_tensors_fail_on_every_rank(tmp_path):
    case = {"name": "mismatch", "machine": "cpu_2numa", "sizes": [100], "mismatch": True}
    records = run_local(tmp_path, 4, [case], timeout=3)["mismatch"]
    for r, rec in enumerate(records):
        err = rec["error"] or ""
        # every rank meets rank 1 in the first barrier: all name both sizes
        assert "TensorMismatchError" in err, (r, err)
        assert "400 bytes of float32" in err and "404 bytes of float32" in err, (r, err)


def test_a_missing_rank_times_out_naming_it(tmp_path):
    case = {"name": "missing", "machine": "cpu_2numa", "sizes": [64], "skip_op": True}
    records = run_local(tmp_path, 3, [case], timeout=2)["missing"]
    errors = [rec["error"] or "" for rec in records[:2]]
    # one of them times out naming rank 2; the other either does too or finds that one gone first
    assert all(e.startswith("BytePSTimeoutError") for e in errors), errors
    assert any("local rank(s) [2]" in e or "local rank 2 has gone away" in e for e in errors), errors
    assert records[2]["error"] is None


def test_many_small_operations_in_a_row(tmp_path):
    """Back-to-back barriers among 8 processes overflow the datagram queues (often 10 deep): the
    senders must keep draining while they retry, and no operation may mix with the next."""
    case = {"name": "burst", "machine": "cpu_2numa", "overrides": {"switch_size": 2}, "sizes": [5, 1, 9] * 20}
    records = run_local(tmp_path, 8, [case], wall=240)["burst"]
    assert records[0]["plan"] == ["cpu_assisted", [[0, 1], [2, 3], [4, 5], [6, 7]], []]
    check_sums(tmp_path, records, case, 8)
