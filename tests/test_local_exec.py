"""BYTEPS_LOCAL_STRATEGY=topology: the topology plan's executors inside real jobs (core/local_exec.py).

Real scheduler, servers and 2 worker machines of 2-4 processes each (tests/conftest.py), every
push_pull aggregated on each machine by the forced strategy's executor (topology/cpu_exec.py),
its ranges pushed and pulled by the engine. Results are compared exactly with sums computed here
(small integers: exact in every dtype), and each job checks that the executor really ran what was
forced (strategy, groups, PCIE_REDUCE, which ranks pushed), since the default path would produce
the same sums. Bad input: a size that differs, tensors submitted in different orders by a
machine's processes, a process that never submits; each must end in a clear error, never a hang.
"""
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from scenarios_local_exec import values  # noqa: E402

from byteps.core import local_exec  # noqa: E402
from byteps.errors import ConfigError  # noqa: E402

#: 4 KB partitions: a tensor of 10,000 float32 is 10 partitions, and the executors work in chunks of
#: 16 partitions (64 KB), so 40,000 float32 is three chunks
BASE_ENV = {"BYTEPS_LOCAL_STRATEGY": "topology", "BYTEPS_PARTITION_BYTES": "4096"}
#: fewer elements than processes, one partition, many partitions (not a multiple of anything), several chunks
COUNTS = [1, 3, 700, 10007, 40000]
DTYPES = ["float32", "float64", "int32", "float16"]


def tensors(dtypes=DTYPES, counts=COUNTS):
    return [{"name": f"{dt}.{n}", "count": n, "dtype": dt} for dt in dtypes for n in counts]


def dev_shm():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def run(cluster, machines, local_size, scenario, args, env, servers=2, timeout=120):
    before = dev_shm()
    c = cluster(machines, servers, local_size, env={**BASE_ENV, **env})
    c.run_workers(scenario, args)
    codes = c.wait_workers(timeout)
    assert codes == [0] * len(codes), f"worker exit codes {codes}\n{c.all_logs()}"
    res = c.results()
    assert len(res) == machines * local_size, c.all_logs()
    for rank, r in res.items():
        assert "error" not in r, f"rank {rank}: {r['error']}\n{c.all_logs()}"
    leaked = [n for n in dev_shm() - before if "byteps" in n or n.startswith("bps")]
    assert not leaked, f"left in /dev/shm: {leaked}"
    return c, res


def check_sums(res, specs, rounds):
    size = len(res)
    for rnd in range(rounds):
        for index, spec in enumerate(specs):
            total = sum(values(r, rnd, index, spec["count"], np.int64) for r in range(size))
            if spec["dtype"] == "bfloat16":  # compared as raw 16-bit patterns (numpy has no bfloat16)
                import torch

                dtype = np.dtype(np.uint16)
                expect = torch.from_numpy(total.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
                expect = expect.view(np.uint16)
            else:
                dtype = np.dtype(spec["dtype"])
                expect = total.astype(dtype)
            for rank, r in res.items():
                got = np.frombuffer(bytes.fromhex(r["value"]["sums"][f"{spec['name']}@{rnd}"]), dtype=dtype)
                assert np.array_equal(got, expect), (
                    f"{spec['name']} round {rnd}, rank {rank}: first differences at "
                    f"{np.flatnonzero(got != expect)[:5]}")


def executors(res):
    return {rank: r["value"]["executor"] for rank, r in res.items()}


def check_arenas(res):
    for rank, r in res.items():
        assert r["value"]["arenas_before"] >= 1, f"rank {rank} held no executor arena: the topology path did not run"
        assert r["value"]["arenas_after"] == 0, f"rank {rank} still holds executor arenas after shutdown()"


# ---------------------------------------------------------------------------------------------- sums


def test_cpu_assisted_with_two_groups_runs_pcie_reduce(cluster):
    """2 machines x 4 processes in two groups of 2: reduce-scatter in each group, PCIE_REDUCE across
    groups (every process sums its range), network per range, copy back, gather."""
    specs = tensors()
    _, res = run(cluster, 2, 4, "topology_sums", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_INTRA_STRATEGY": "cpu_assisted", "BYTEPS_PCIE_SWITCH_SIZE": "2"})
    check_sums(res, specs, 2)
    check_arenas(res)
    for rank, ex in executors(res).items():
        assert ex["strategy"] == "cpu_assisted" and ex["groups"] == [[0, 1], [2, 3]], ex
        assert ex["stats"]["ops"] == 2 * len(specs), ex
        assert ex["cpu"]["pcie_reduce"] > 0 and ex["cpu"]["group_reduce"] > 0, ex
        # every process owns one range per chunk (tensors of 1 and 3 elements leave some ranges empty)
        assert ex["stats"]["ranges"] == ex["cpu"]["network"] > 0, ex
    for rank, r in res.items():  # the ranges went through the native core's stages (byteps.metrics())
        assert r["stages"].get("push", 0) == r["stages"].get("pull", 0) > 0, (rank, r["stages"])


def test_one_machine_with_a_colocated_server(cluster):
    """1 machine x 2 processes and its colocated server, which answers a lone machine with the
    pusher's own shared region (the engine then copies nothing back): sums stay exact."""
    specs = tensors()
    _, res = run(cluster, 1, 2, "topology_sums", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_INTRA_STRATEGY": "reduce_scatter"}, servers=1)
    check_sums(res, specs, 2)
    check_arenas(res)
    for rank, r in res.items():  # the server reads each range from the executor's arena: no STAGE copy
        assert r["stages"].get("stage", 0) == r["stages"].get("push", 0) > 0, (rank, r["stages"])


def test_compressed_ranges_are_encoded_by_the_native_core(cluster):
    """fp16 on the wire, servers on no worker's machine: the native core encodes each range's
    partitions on their way out and decodes the replies (float32 and float64; int32 travels raw).
    The values are small integers, exact in fp16, so the sums stay exact; byteps.metrics() counts the
    encoded pushes among all the pushes."""
    specs = tensors(["float32", "float64", "int32"], [700, 10007])
    _, res = run(cluster, 2, 2, "topology_sums", {"tensors": specs, "rounds": 2, "compression": "fp16"},
                 {"BYTEPS_INTRA_STRATEGY": "reduce_scatter", "BYTEPS_ENABLE_IPC": "0"}, servers=1)
    check_sums(res, specs, 2)
    for rank, r in res.items():
        assert 0 < r["compressed_pushes"] < r["stages"]["push"], (rank, r["compressed_pushes"], r["stages"])


def test_reduce_broadcast_pushes_only_from_the_roots(cluster):
    """2 machines x 3 processes, roots 1 and 2: partitions round-robin over the roots, which alone
    reduce and push; local rank 0 only broadcasts."""
    specs = tensors()
    _, res = run(cluster, 2, 3, "topology_sums", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_REDUCE_ROOTS": "1,2"})
    check_sums(res, specs, 2)
    check_arenas(res)
    for rank, ex in executors(res).items():
        assert ex["strategy"] == "reduce_broadcast" and ex["roots"] == [1, 2], ex
        local_rank = rank % 3
        if local_rank == 0:
            assert ex["stats"].get("ranges", 0) == 0 and ex["cpu"].get("root_reduce", 0) == 0, ex
        else:
            assert ex["stats"]["ranges"] == ex["cpu"]["root_reduce"] > 0, ex


def test_reduce_scatter_two_processes(cluster):
    specs = tensors()
    _, res = run(cluster, 2, 2, "topology_sums", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_INTRA_STRATEGY": "reduce_scatter"}, servers=1)
    check_sums(res, specs, 2)
    for rank, ex in executors(res).items():
        assert ex["strategy"] == "reduce_scatter" and ex["groups"] == [[0, 1]], ex
        assert ex["cpu"].get("pcie_reduce", 0) == 0 and ex["stats"]["ranges"] > 0, ex


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"BYTEPS_INTRA_STRATEGY": "reduce_scatter"},
                                 {"BYTEPS_TOPOLOGY_FILE": "cpu_2numa"},
                                 {"BYTEPS_REDUCE_ROOTS": "3", "BYTEPS_PARTITION_BYTES": "1000"}],
                         ids=["reduce_scatter", "cpu_2numa_auto", "one_root"])
def test_more_plans_with_four_processes(cluster, env):
    env = dict(env)
    if env.get("BYTEPS_TOPOLOGY_FILE"):
        env["BYTEPS_TOPOLOGY_FILE"] = os.path.join(HERE, "..", "topology", "fixtures", "cpu_2numa.json")
    specs = tensors(DTYPES + ["int64", "uint8", "bfloat16"])
    _, res = run(cluster, 2, 4, "topology_sums", {"tensors": specs, "rounds": 3}, env, timeout=240)
    check_sums(res, specs, 3)
    if "BYTEPS_TOPOLOGY_FILE" in env:  # the rules' choice: cpu_assisted over the two NUMA nodes
        assert all(ex["strategy"] == "cpu_assisted" and ex["groups"] == [[0, 1], [2, 3]]
                   for ex in executors(res).values())


# ---------------------------------------------------------------------------------------------- errors


def test_bad_input_fails_clearly_on_every_rank(cluster):
    """A size that differs under one name: the scheduler's error on every rank. Local rank 1 of each
    machine submitting two tensors in the other order: both fail on every local process of the
    machine, naming the local ranks, their sizes and tensor keys. The path still works afterwards."""
    _, res = run(cluster, 2, 2, "topology_errors", {}, {}, servers=1)
    for rank, r in res.items():
        got = r["value"]
        assert got["size"].startswith("TensorMismatchError") and "float32[10]" in got["size"] \
            and "float32[11]" in got["size"] and "rank 1" in got["size"], got["size"]
        for name in ("a", "b"):
            err = got["order"][name]
            assert err.startswith("TensorMismatchError"), (rank, name, err)
            assert "400 bytes of float32" in err and "800 bytes of float32" in err, err
            assert "local rank 0" in err and "local rank 1" in err and "same order" in err, err
        assert got["after"] == [float(sum(range(1, 5)))] * 7, got["after"]


def test_a_process_that_never_submits_is_named(cluster):
    """Local rank 1 of machine 0 skips a push_pull: its peer times out naming it; machine 1's processes
    time out waiting for the servers (machine 0 never pushes). Nobody hangs."""
    timeout = 8  # also bounds start-up, which takes a few seconds on a loaded 2-core machine
    _, res = run(cluster, 2, 2, "topology_missing", {"hold": timeout + 5}, {"BYTEPS_TIMEOUT": str(timeout)},
                 servers=1)
    assert res[1]["value"].get("skipped")
    err = res[0]["value"]["error"]
    assert err.startswith("BytePSTimeoutError") and "local rank(s) [1]" in err, err
    for rank in (2, 3):
        err = res[rank]["value"]["error"]
        assert ("BytePSTimeoutError" in err or "LocalPeerError" in err) and "server 0" in err, err
    for rank in (0, 2, 3):
        assert res[rank]["value"]["seconds"] < 3 * timeout + 10


@pytest.mark.parametrize("other", [
    {"BYTEPS_INTRA_STRATEGY": "reduce_broadcast"},
    pytest.param({"BYTEPS_LOCAL_STRATEGY": "owners"}, marks=pytest.mark.slow)], ids=["cut", "owners"])
def test_machines_that_cut_differently_get_a_clear_error(cluster, other):
    """Machine 0 cuts tensors into 2 slices; machine 1 into partitions (reduce_broadcast), or does not use
    the topology path at all: the tensor is declared with different operations, and every rank gets the
    scheduler's error naming each rank's (never a sum of different ranges under one key)."""
    c = cluster(2, 1, 2, env={**BASE_ENV, "BYTEPS_INTRA_STRATEGY": "reduce_scatter"})
    c.run_workers("topology_declare", {}, machines=[0])
    c.run_workers("topology_declare", {}, machines=[1], env=other)
    codes = c.wait_workers(90)
    assert codes == [0] * 4, c.all_logs()
    res = c.results()
    assert len(res) == 4, c.all_logs()
    theirs = "in a push_pull;" if "BYTEPS_LOCAL_STRATEGY" in other else "(partitions of 1024 elements"
    for rank, r in res.items():
        for name in ("x", "y"):
            err = r["value"][name]
            assert err.startswith("TensorMismatchError") and "push_pull over local ranges (2 slices" in err \
                and theirs in err and "rank 3" in err, (rank, err)
    # broadcasts do not use the executor: they still work between the two
    assert all(r["value"]["broadcast"] == [1.0] * 3 for r in res.values())


# ---------------------------------------------------------------------------------------------- units


def test_config_validates_the_variable():
    from byteps import config

    assert config.load({}).local_strategy == "owners"
    assert config.load({"BYTEPS_LOCAL_STRATEGY": "Topology"}).local_strategy == "topology"
    with pytest.raises(ConfigError, match="BYTEPS_LOCAL_STRATEGY='nccl' must be one of owners, topology"):
        config.load({"BYTEPS_LOCAL_STRATEGY": "nccl"})


@pytest.mark.parametrize("overrides", [{}, {"strategy": "reduce_broadcast", "roots": (1, 2)},
                                       {"strategy": "reduce_scatter"}, {"switch_size": 2}])
@pytest.mark.parametrize("count,itemsize", [(0, 4), (1, 4), (3, 8), (10007, 4), (200000, 2), (70001, 8)])
def test_layout_tiles_every_chunk(overrides, count, itemsize):
    import byteps.topology as topology

    plan = topology.plan(machine="cpu_2numa", local_size=4, overrides=overrides, env={})
    lay = local_exec.layout(plan, count, itemsize, 4096)
    assert lay.chunks[0][0] == 0 and lay.chunks[-1][1] == count
    index = 0
    for (c0, c1, first, ranges), nxt in zip(lay.chunks, [*lay.chunks[1:], None]):
        assert first == index
        index += len(ranges)
        assert c1 - c0 <= local_exec.CHUNK_PARTITIONS * (4096 // itemsize)
        if nxt is not None:
            assert nxt[0] == c1
        assert ranges[0][0] == 0 and ranges[-1][1] == c1 - c0
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        owners = [o for *_, o in ranges]
        if plan.strategy == "reduce_broadcast":
            assert set(owners) <= {1, 2}
        else:
            assert owners == list(range(4))
    assert index < 1 << local_exec.RANGE_BITS


def test_layout_kind_names_the_cut():
    import byteps.topology as topology

    slices = topology.plan(machine="cpu_2numa", local_size=4, env={})
    parts = topology.plan(machine="cpu_2numa", local_size=4, overrides={"strategy": "reduce_broadcast"}, env={})
    three = topology.plan(machine="cpu_2numa", local_size=3, env={})
    kinds = {local_exec.layout(p, 100, 4, 4096).kind for p in (slices, parts, three)}
    assert len(kinds) == 3  # a different cut is a different declared operation
    assert local_exec.layout(slices, 100, 4, 4096).kind == local_exec.layout(slices, 100, 4, 4096).kind
    assert local_exec.layout(slices, 100, 4, 4096).kind != local_exec.layout(slices, 100, 4, 8192).kind


def test_too_many_ranges_is_a_clear_error():
    import byteps.topology as topology

    plan = topology.plan(machine="cpu_2numa", local_size=4, overrides={"strategy": "reduce_broadcast"}, env={})
    with pytest.raises(Exception, match="more than the 65536 its wire keys can number; raise BYTEPS_PARTITION_BYTES"):
        local_exec.layout(plan, 70000 * 16, 1, 16)


def test_token_differs_by_job_epoch_and_machine():
    from byteps import config

    cfg = config.load({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                       "DMLC_PS_ROOT_PORT": "9000", "DMLC_WORKER_ID": "1", "BYTEPS_JOB_ID": "j"})
    t = local_exec.token(cfg, {"epoch": 0})
    assert t != local_exec.token(cfg, {"epoch": 1})
    assert t.endswith("-w1") and len(t) < 40  # abstract socket names stay short


def test_locate_names_arenas_of_the_group():
    import uuid

    from byteps.topology.localsync import LocalGroup

    g = LocalGroup(uuid.uuid4().hex[:12], 0, 1, 1 << 16, timeout=5)
    try:
        view = g.peers[0][4096:8192]
        pid, fd, inode, off = g.locate(view)
        assert (pid, fd, inode, off) == (os.getpid(), g.arena.fd, g.arena.inode, 4096)
        assert g.locate(np.zeros(10, dtype=np.uint8)) is None
    finally:
        g.close()


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_reason(min_devices):
    from byteps.core import gpu

    reason = gpu.unavailable_reason(need_nccl=True, min_devices=min_devices)
    if reason:
        return reason
    import torch

    if not torch.cuda.is_available():
        return "torch has no CUDA (a CPU build?)"
    return None


def test_gpu_engine_path_cuda_tensors(cluster):
    """CUDA tensors through the engine: GpuExecutor (NCCL + pinned staging) per machine, ranges pushed
    by the engine; tensors are produced on a side stream and submitted unsynchronized (the stages must
    wait for it), bfloat16 included. Needs 2 GPUs, NCCL and a CUDA torch; skips saying why otherwise.
    tests/test_gpu_stages.py runs the same hand-over on a fake GPU everywhere."""
    reason = _gpu_reason(2)
    if reason:
        pytest.skip(reason)
    specs = tensors(["float32", "float64", "int32", "float16", "bfloat16"], [1, 3, 10007, 40000])
    _, res = run(cluster, 2, 2, "topology_cuda", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_INTRA_STRATEGY": "reduce_scatter"}, servers=1, timeout=300)
    check_sums(res, specs, 2)
    for rank, r in res.items():
        assert r["value"]["gpu_used"], r["value"]


@pytest.mark.parametrize("machines,local_size", [(2, 1), (1, 2)])
def test_cuda_tensors_on_the_default_path(cluster, machines, local_size):
    """CUDA tensors without the topology executor (the default): copied off the GPU and back per partition
    by the native core (COPYD2H / COPYH2D), pushed and pulled. One GPU is enough: every process may share
    it. Results exact, on the input's device, out-of-place inputs left alone; DistributedOptimizer's CUDA
    gradients through the same stages, exact; DDP's buckets through bps.ddp_comm_hook, exact. Skips
    without CUDA, saying why."""
    from byteps.core import gpu

    reason = gpu.unavailable_reason(need_nccl=False, min_devices=1)
    if reason is None:
        import torch

        reason = None if torch.cuda.is_available() else "torch has no CUDA (a CPU build?)"
    if reason:
        pytest.skip(reason)
    specs = tensors(["float32", "float64", "int32", "float16", "bfloat16"], [1, 10007, (1 << 20) + 3])
    _, res = run(cluster, machines, local_size, "cuda_default_path", {"tensors": specs, "rounds": 3},
                 {"BYTEPS_LOCAL_STRATEGY": "owners"}, servers=1, timeout=300)
    check_sums(res, specs, 3)
    for rank, r in res.items():
        v = r["value"]
        assert set(v["devices"]) == {v["device"]}, (rank, v["devices"])
        assert v["inputs_changed"] == [], (rank, v["inputs_changed"])
        assert v["broadcast"] == [1.0], (rank, v["broadcast"])
        # DistributedOptimizer: 3 SGD steps (lr 1) of the averaged gradient n + 1, exactly; the unused
        # layer's zero gradients leave it at 0; both gradients of every step went through the copy stages
        n = machines * local_size
        assert v["weights"] == [1.0 - 3 * (n + 1)], (rank, v["weights"])
        assert v["unused"] == [0.0], (rank, v["unused"])
        assert v["copies"] >= 6 * 2, (rank, v["copies"])  # each gradient off the GPU and back, at least
        # DDP's communication hook on the same CUDA layer: its one bucket averaged every step, exactly
        ddp = v["ddp"]
        assert ddp["weights"] == [1.0 - 3 * (n + 1)], (rank, ddp)
        assert ddp["calls"] == [v["device"]] and ddp["hook_calls"] == 3, (rank, ddp)


def test_executor_stage_lists():
    import byteps.topology as topology
    from byteps.core.stages import Stage as S, executor_stage_list

    two = topology.plan(machine="cpu_2numa", local_size=4, env={})
    one = topology.plan(machine="cpu_2numa", local_size=4, overrides={"strategy": "reduce_scatter"}, env={})
    assert executor_stage_list(two) == (S.STAGE, S.LOCAL_REDUCE, S.PCIE_REDUCE, S.PUSH, S.PULL, S.LOCAL_BROADCAST)
    assert executor_stage_list(one, owner=False) == (S.STAGE, S.LOCAL_REDUCE, S.LOCAL_BROADCAST)
    pcie = topology.plan(machine="pcie_only", env={})
    assert executor_stage_list(pcie, "cuda") == (S.NCCL_REDUCE, S.COPYD2H, S.PCIE_REDUCE, S.PUSH, S.PULL, S.COPYH2D,
                                                 S.NCCL_BROADCAST)
    alone = topology.plan(machine="pcie_only", local_size=1, env={})
    assert executor_stage_list(alone, "cuda") == (S.COPYD2H, S.PUSH, S.PULL, S.COPYH2D)
