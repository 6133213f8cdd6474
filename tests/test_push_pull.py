"""Correctness matrix: push_pull sums and averages equal a locally computed ground truth.

n workers x k servers (real scheduler, servers and worker processes on loopback), every
supported dtype, shapes from scalar and empty to multi-partition tensors with an odd tail,
many tensors in flight at once and several rounds of the same names. Each (n, k) point is one
cluster launch running the ``torch_sums`` scenario (tests/scenarios_torch.py) over every spec.

Exactness:
* integer dtypes wrap around exactly like torch's own addition (the "extreme" kind makes every
  sum overflow); integer averages are the floor division of the wrapped sum by the size;
* "int" floats (integers in [-8, 8]) sum exactly in any order and in every float dtype;
* "rand" floats (non-integers): the server adds in arrival order, rounding to the stored dtype
  after each add. For n <= 2 the result is order-free (a + b == b + a) and compared exactly;
  for n >= 3 each element must equal the sum in *some* order (all n! orders are computed),
  which is still a bit-exact check;
* float averages are the sum divided by n in the same dtype (what torch computes).
Every rank must receive identical bytes.
"""
import functools
import itertools
import operator
import os
import sys

import pytest
import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find scenarios_torch
from scenarios import digest  # noqa: E402
from scenarios_torch import make_tensor, undigest  # noqa: E402

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"]
FLOATS = {"float32", "float64", "float16", "bfloat16"}
#: scalar, empty, tiny, 2-D, and multi-partition tensors with an odd tail (BYTEPS_PARTITION_BYTES=1000:
#: float32 (1001,) is 4004 bytes = 5 partitions, the last one element; float64 (3, 257) is 7 partitions)
FULL_SHAPES = [(), (0,), (3, 0), (1,), (7,), (4, 5), (1001,), (3, 257)]
SMALL_SHAPES = [(), (0,), (5,), (1001,)]
PARTITION_ENV = {"BYTEPS_PARTITION_BYTES": "1000"}


def specs(shapes, extreme=True, order_free=False, dtypes=None):
    """Every (dtype, kind, shape, sum/average), of ``dtypes`` if given. ``order_free`` drops non-integer
    floats, whose sum depends on the summation tree (a local reduce adds a machine's values before the server)."""
    out = []
    for dtype in dtypes or DTYPES:
        kinds = ["int", "rand"] if dtype in FLOATS else (["rand", "extreme"] if extreme else ["rand"])
        if order_free and dtype in FLOATS:
            kinds = ["int"]
        for kind in kinds:
            for shape in shapes:
                if kind == "extreme" and 0 in shape:
                    continue
                for average in (False, True):
                    name = f"{dtype}.{kind}.{'avg' if average else 'sum'}.{'x'.join(map(str, shape)) or 'scalar'}"
                    out.append({"name": name, "dtype": dtype, "shape": list(shape), "kind": kind,
                                "average": average})
    return out


def candidates(spec, n, rnd):
    """Every result the Summation Service may legitimately return (one, unless the order matters)."""
    ts = [make_tensor(r, spec, rnd) for r in range(n)]
    if spec["dtype"] in FLOATS and spec["kind"] == "rand" and n >= 3:
        orders = itertools.permutations(ts)
    else:
        orders = [ts]
    out = []
    for order in orders:
        s = functools.reduce(operator.add, order)  # torch's own addition: rounds / wraps per add
        if spec["average"] and n > 1:
            s = s / n if s.dtype.is_floating_point else torch.floor_divide(s, n)
        assert s.dtype == ts[0].dtype
        out.append(s)
    return out


def check_matrix(cluster, machines, k, shapes, rounds=2, extreme=True, ipc=True, local_size=1, push="owners",
                 extra_env=None, colocated=None, dtypes=None):
    env = dict(PARTITION_ENV, BYTEPS_ENABLE_IPC="1" if ipc else "0", BYTEPS_LOCAL_PUSH=push, **(extra_env or {}))
    colocated = ipc if colocated is None else colocated
    n = machines * local_size  # ranks
    if n == 1:
        env["BYTEPS_FORCE_DISTRIBUTED"] = "1"
    all_specs = specs(shapes, extreme, order_free=local_size > 1, dtypes=dtypes)
    c = cluster(machines, k, local_size=local_size, env=env)
    c.run_workers("torch_sums", {"tensors": all_specs, "rounds": rounds})
    codes, server_codes, sched_code = c.wait_all(90)
    assert codes == [0] * n, f"worker exit codes {codes}\n{c.all_logs()}"
    assert server_codes == [0] * k and sched_code == 0, f"servers {server_codes}, scheduler {sched_code}\n" \
                                                        f"{c.all_logs()}"
    res = c.results()
    assert sorted(res) == list(range(n)), f"results from ranks {sorted(res)}\n{c.all_logs()}"
    for r in range(n):  # the transport under test was really used
        assert res[r].get("colocated") == [colocated] * k, (r, res[r].get("colocated"))
        assert res[r].get("local_reduce") == (local_size if local_size > 1 else None), res[r]
    for r in range(n):
        assert "error" not in res[r], f"rank {r}: {res[r].get('error')}\n{c.all_logs()}"
        assert res[r]["size"] == n
    problems = []
    for rnd in range(rounds):
        for spec in all_specs:
            key = f"{spec['name']}@{rnd}"
            got_hex = {r: res[r]["value"][key] for r in range(n)}
            if len(set(got_hex.values())) != 1:
                problems.append(f"{key}: ranks received different bytes")
                continue
            dtype = getattr(torch, spec["dtype"])
            got = undigest(got_hex[0], dtype, tuple(spec["shape"]))
            cands = candidates(spec, n, rnd)
            if len(cands) == 1:
                want = cands[0]
                if digest(want) != got_hex[0]:  # bit-exact
                    bad = (got != want).nonzero()[:5].tolist()
                    problems.append(f"{key}: differs at {bad}: got {got.reshape(-1)[:6].tolist()} "
                                    f"want {want.reshape(-1)[:6].tolist()}")
            else:
                ok = torch.stack([got == w for w in cands]).any(0)
                if not bool(ok.all()):
                    bad = (~ok).nonzero()[:5].tolist()
                    problems.append(f"{key}: elements {bad} equal no summation order's result "
                                    f"(got {got[tuple(bad[0])].item()}, e.g. want {cands[0][tuple(bad[0])].item()})")
    assert not problems, f"{len(problems)} wrong results (n={n}, k={k}):\n" + "\n".join(problems[:40])
    return res


FULL_POINTS = [(1, 1), (2, 2), (3, 3), (4, 2)]
SMALL_POINTS = [(n, k) for n in (1, 2, 3, 4) for k in (1, 2, 3) if (n, k) not in FULL_POINTS]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,k", FULL_POINTS, ids=[f"{n}w{k}s" for n, k in FULL_POINTS])
def test_full_matrix(cluster, n, k):
    """Every dtype x every shape x sum/average, 3 rounds, all in flight at once (shared memory)."""
    check_matrix(cluster, n, k, FULL_SHAPES, rounds=3)


#: (machines, processes per machine, servers, shared memory with servers)
LOCAL_POINTS = [(1, 2, 1, True), (1, 3, 2, True), (1, 4, 1, True), (2, 2, 2, True), (2, 2, 1, False)]
ROOT_POINTS = [(1, 3, 1, True), (2, 2, 2, False)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("m,l,k,ipc", LOCAL_POINTS, ids=[f"{m}x{l}w{k}s{'-shm' if i else '-tcp'}"
                                                        for m, l, k, i in LOCAL_POINTS])
def test_local_reduce_matrix(cluster, m, l, k, ipc):
    """A machine's processes reduce through shared memory first (one push per machine): every dtype,
    shapes up to several partitions (partition owners spread over local ranks), 3 rounds."""
    check_matrix(cluster, m, k, FULL_SHAPES, rounds=3, ipc=ipc, local_size=l)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("m,l,k,ipc", ROOT_POINTS, ids=[f"{m}x{l}w{k}s{'-shm' if i else '-tcp'}"
                                                       for m, l, k, i in ROOT_POINTS])
def test_local_reduce_by_root(cluster, m, l, k, ipc):
    """BYTEPS_LOCAL_PUSH=root: local rank 0 sums and pushes every partition of its machine."""
    check_matrix(cluster, m, k, FULL_SHAPES, rounds=2, ipc=ipc, local_size=l, push="root")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,k", SMALL_POINTS, ids=[f"{n}w{k}s" for n, k in SMALL_POINTS])
def test_small_matrix(cluster, n, k):
    """Every dtype on a few shapes (scalar, empty, small, multi-partition), 2 rounds (over TCP)."""
    check_matrix(cluster, n, k, SMALL_SHAPES, rounds=2, extreme=False, ipc=False)


def test_candidates_sanity():
    """The ground truth itself: wrap-around and floor division as documented, no server needed."""
    spec = {"dtype": "uint8", "shape": [4], "kind": "extreme", "average": False}
    s = candidates(spec, 2, 0)[0]
    a, b = make_tensor(0, spec), make_tensor(1, spec)
    assert torch.equal(s, ((a.int() + b.int()) % 256).to(torch.uint8))
    spec = {"dtype": "int8", "shape": [50], "kind": "rand", "average": True}
    ts = [make_tensor(r, spec) for r in range(3)]
    wrapped = ((sum(t.int() for t in ts) + 128) % 256 - 128)
    assert torch.equal(candidates(spec, 3, 0)[0].int(), torch.div(wrapped, 3, rounding_mode="floor"))
    spec = {"dtype": "float16", "shape": [50], "kind": "int", "average": False}
    assert torch.equal(candidates(spec, 4, 1)[0].double(), sum(make_tensor(r, spec, 1).double() for r in range(4)))


# Pipeline variants (core/stages.py, summation/native/sum_pool.h): server engine threads, the STAGE copy
# on its own thread (partitions >= 256 KB), and BYTEPS_PIPELINE dropping optional stages.
BIG_SHAPES = [(1001,), (200000,), (3, 70001)]  # 800 KB and 840 KB of float32: 300 KB pieces per server


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,k,threads,ipc", [(3, 2, 2, True), (2, 1, 3, False), (4, 2, 1, True)],
                         ids=["3w2s-2threads-shm", "2w1s-3threads-tcp", "4w2s-1thread-shm"])
def test_server_engine_threads(cluster, n, k, threads, ipc):
    check_matrix(cluster, n, k, SMALL_SHAPES + [(3, 257)], rounds=3, ipc=ipc,
                 extra_env={"BYTEPS_SERVER_ENGINE_THREAD": str(threads)})


@pytest.mark.timeout(150)
@pytest.mark.parametrize("threads", [0, 2])
def test_copy_stage_thread_with_large_partitions(cluster, threads):
    check_matrix(cluster, 2, 2, BIG_SHAPES, rounds=3, extreme=False,
                 extra_env={"BYTEPS_PARTITION_BYTES": "600000", "BYTEPS_SERVER_ENGINE_THREAD": str(threads)})


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ipc", [False, True], ids=["tcp", "shm"])
def test_message_transports(cluster, ipc):
    """Exact sums with partitions below and above the size (64 KB) where pushes stop being copied and
    go zero-copy from the tensor (core/pipeline/worker_send_queue.h)."""
    big = [(3, 70001)]  # 840 KB of float32: 300 KB partitions, 150 KB pieces per server, over 64 KB
    check_matrix(cluster, 2, 2, SMALL_SHAPES + big, rounds=2, extreme=False, ipc=ipc,
                 extra_env={"BYTEPS_PARTITION_BYTES": "300000"})


@pytest.mark.timeout(150)
def test_pipeline_without_stage_copy_uses_tcp(cluster):
    check_matrix(cluster, 2, 1, SMALL_SHAPES, ipc=True, colocated=False, extra_env={"BYTEPS_PIPELINE": "-stage"})


@pytest.mark.timeout(150)
def test_pipeline_without_local_reduce(cluster):
    """BYTEPS_PIPELINE=-local_reduce: a machine's processes push separately (no local reduce)."""
    env = dict(PARTITION_ENV, BYTEPS_PIPELINE="-local_reduce")
    c = cluster(1, 1, local_size=2, env=env)
    c.run_workers("torch_sums", {"tensors": specs([(5,), (1001,)], order_free=True), "rounds": 1})
    codes, _, _ = c.wait_all(90)
    assert codes == [0, 0], c.all_logs()
    res = c.results()
    assert [res[r]["local_reduce"] for r in (0, 1)] == [None, None], res
    assert res[0]["value"] == res[1]["value"]
