"""BYTEPS_LOCAL_STRATEGY=topology inside real jobs: host tensors take the native local reduce with the
owners the machine's topology plan names (core/local.py); CUDA push_pulls on a machine of GPUs take
the NCCL stages (core/pipeline/nccl_stages.h; tests/test_nccl_stages.py runs them on a fake GPU).

Real scheduler, servers and 2 worker machines of 2-4 processes each (tests/conftest.py). Results
are compared exactly with sums computed here (small integers: exact in every dtype), and each job
checks through byteps.metrics() that what was forced really ran (the plan's strategy and groups,
which local ranks reduced and pushed), since the default owners would produce the same sums.
Owners are each machine's own choice: machines of different plans (or strategies) work together,
and a machine's processes may submit in any order.
"""
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from scenarios_local_strategy import values  # noqa: E402

from byteps.errors import ConfigError  # noqa: E402

#: 4 KB partitions: a tensor of 10,000 float32 is 10 partitions
BASE_ENV = {"BYTEPS_LOCAL_STRATEGY": "topology", "BYTEPS_PARTITION_BYTES": "4096"}
#: fewer elements than processes, one partition, many partitions (not a multiple of anything)
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


def local(res):
    """{rank: byteps.metrics()["local_strategy"]}, after checking no process takes the NCCL stages (the
    plans here have no GPUs)."""
    for rank, r in res.items():
        assert r["value"]["local"]["nccl_stages"] is False, (rank, r["value"]["local"])
    return {rank: r["value"]["local"] for rank, r in res.items()}


def reduced(r):
    """Partitions this process reduced for its machine (the owner's LOCAL_REDUCE) and pushed."""
    return r["native_local"]["reduced"], r["stages"].get("push", 0)


# ---------------------------------------------------------------------------------------------- sums


def test_cpu_assisted_with_two_groups(cluster):
    """2 machines x 4 processes in two groups of 2 (the plan's groups): every process owns partitions in
    turn, reduces the machine's copies of each natively and pushes it."""
    specs = tensors()
    _, res = run(cluster, 2, 4, "topology_sums", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_INTRA_STRATEGY": "cpu_assisted", "BYTEPS_PCIE_SWITCH_SIZE": "2"})
    check_sums(res, specs, 2)
    for rank, lo in local(res).items():
        assert lo == {"owners": "topology", "plan": "cpu_assisted", "groups": [[0, 1], [2, 3]], "roots": [],
                      "nccl_stages": False}, lo
    for rank, r in res.items():  # every process owns some partitions, and its own never went elsewhere
        got, pushed = reduced(r)
        assert got > 0 and pushed == got and r["native_local"]["coordinated"] > 0, (rank, r["native_local"])


def test_one_machine_with_a_colocated_server(cluster):
    """1 machine x 2 processes and its colocated server: the lone machine's local sum is the whole sum."""
    specs = tensors()
    _, res = run(cluster, 1, 2, "topology_sums", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_INTRA_STRATEGY": "reduce_scatter"}, servers=1)
    check_sums(res, specs, 2)
    assert all(lo["plan"] == "reduce_scatter" for lo in local(res).values())


def test_compressed_partitions_are_encoded_by_the_native_core(cluster):
    """fp16 on the wire, servers on no worker's machine: the owners encode their partitions on their way
    out and decode the replies (float32 and float64; int32 travels raw). The values are small integers,
    exact in fp16, so the sums stay exact; byteps.metrics() counts the encoded pushes among all."""
    specs = tensors(["float32", "float64", "int32"], [700, 10007])
    _, res = run(cluster, 2, 2, "topology_sums", {"tensors": specs, "rounds": 2, "compression": "fp16"},
                 {"BYTEPS_INTRA_STRATEGY": "reduce_scatter", "BYTEPS_ENABLE_IPC": "0"}, servers=1)
    check_sums(res, specs, 2)
    for rank, r in res.items():
        assert 0 < r["compressed_pushes"] < r["stages"]["push"], (rank, r["compressed_pushes"], r["stages"])


def test_reduce_broadcast_pushes_only_from_the_roots(cluster):
    """2 machines x 3 processes, roots 1 and 2: partitions go round-robin over the roots, which alone
    reduce and push; local rank 0 only hands its copies over and takes the results."""
    specs = tensors()
    _, res = run(cluster, 2, 3, "topology_sums", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_REDUCE_ROOTS": "1,2"})
    check_sums(res, specs, 2)
    for rank, lo in local(res).items():
        assert lo["plan"] == "reduce_broadcast" and lo["roots"] == [1, 2], lo
    for rank, r in res.items():
        got, pushed = reduced(r)
        if rank % 3 == 0:
            assert got == pushed == 0 and r["native_local"]["coordinated"] > 0, (rank, r["native_local"], r["stages"])
        else:
            assert got > 0 and pushed == got, (rank, r["native_local"], r["stages"])


def test_reduce_scatter_two_processes(cluster):
    specs = tensors()
    _, res = run(cluster, 2, 2, "topology_sums", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_INTRA_STRATEGY": "reduce_scatter"}, servers=1)
    check_sums(res, specs, 2)
    for rank, lo in local(res).items():
        assert lo["plan"] == "reduce_scatter" and lo["groups"] == [[0, 1]], lo
    assert all(reduced(r)[0] > 0 for r in res.values())


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
        assert all(lo["plan"] == "cpu_assisted" and lo["groups"] == [[0, 1], [2, 3]] for lo in local(res).values())


@pytest.mark.parametrize("other", [
    {"BYTEPS_INTRA_STRATEGY": "reduce_broadcast"},
    pytest.param({"BYTEPS_LOCAL_STRATEGY": "owners"}, marks=pytest.mark.slow)], ids=["plan", "owners"])
def test_machines_of_different_plans_work_together(cluster, other):
    """Machine 0 gives each process a slice of the partitions, machine 1 gives them to one root in turn
    (reduce_broadcast), or uses the default owners: servers count one push per machine and key, whoever
    makes it, so every sum is exact; a broadcast too."""
    c = cluster(2, 1, 2, env={**BASE_ENV, "BYTEPS_INTRA_STRATEGY": "reduce_scatter"})
    c.run_workers("topology_declare", {}, machines=[0])
    c.run_workers("topology_declare", {}, machines=[1], env=other)
    codes = c.wait_workers(90)
    assert codes == [0] * 4, c.all_logs()
    res = c.results()
    assert len(res) == 4, c.all_logs()
    for rank, r in res.items():
        assert r["value"]["x"] == r["value"]["y"] == [4.0] * 5, (rank, r["value"])
        assert r["value"]["broadcast"] == [1.0] * 3, (rank, r["value"])


def test_owners_follow_the_plan():
    """LocalPlan.owner: the roots in turn for reduce_broadcast; every rank in turn otherwise (a
    reduce-scatter at partition granularity), rank 0 for BYTEPS_LOCAL_PUSH=root; rotated by tensor key."""
    import byteps.topology as topology
    from byteps.core.local import LocalPlan

    peers = [{"local_rank": r} for r in range(4)]
    scatter = LocalPlan(peers, topology=topology.plan(machine="cpu_2numa", local_size=4, env={}))
    assert scatter.topology.strategy == "cpu_assisted"
    assert [scatter.owner(1, i) for i in range(6)] == [1, 2, 3, 0, 1, 2]
    assert [scatter.owner(k, 0) for k in range(4)] == [0, 1, 2, 3]  # one-partition tensors spread by key
    roots = LocalPlan(peers, topology=topology.plan(machine="cpu_2numa", local_size=4,
                                                   overrides={"roots": (1, 3)}, env={}))
    assert [roots.owner(0, i) for i in range(5)] == [1, 3, 1, 3, 1]
    assert [roots.owner(1, i) for i in range(2)] == [3, 1]
    assert [LocalPlan(peers).owner(1, i) for i in range(6)] == [1, 2, 3, 0, 1, 2]
    assert [LocalPlan(peers, "root").owner(1, i) for i in range(3)] == [0, 0, 0]
    # a plan of another size than the machine's (a fixture) is not used: the default owners
    other = LocalPlan(peers[:2], topology=topology.plan(machine="cpu_2numa", local_size=4,
                                                       overrides={"roots": (3,)}, env={}))
    assert other.topology is None and [other.owner(0, i) for i in range(2)] == [0, 1]


# ---------------------------------------------------------------------------------------------- units


def test_config_validates_the_variable():
    from byteps import config

    assert config.load({}).local_strategy == "owners"
    assert config.load({"BYTEPS_LOCAL_STRATEGY": "Topology"}).local_strategy == "topology"
    with pytest.raises(ConfigError, match="BYTEPS_LOCAL_STRATEGY='nccl' must be one of owners, topology"):
        config.load({"BYTEPS_LOCAL_STRATEGY": "nccl"})


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


def test_nccl_stages_on_gpus(cluster):
    """CUDA push_pulls on the NCCL stages: 2 machines of 2 GPU processes, tensors produced on a side
    stream and submitted unsynchronized (the stages must wait for it), bfloat16 included. Needs 2 GPUs,
    NCCL and a CUDA torch; skips saying why otherwise. tests/test_nccl_stages.py runs the same stages on
    a fake GPU everywhere."""
    reason = _gpu_reason(2)
    if reason:
        pytest.skip(reason)
    specs = tensors(["float32", "float64", "int32", "float16", "bfloat16"], [1, 3, 10007, 40000])
    _, res = run(cluster, 2, 2, "topology_cuda", {"tensors": specs, "rounds": 2},
                 {"BYTEPS_INTRA_STRATEGY": "reduce_scatter"}, servers=1, timeout=300)
    check_sums(res, specs, 2)
    for rank, r in res.items():
        assert r["value"]["nccl_stages"] and r["value"]["collectives"] > 0, r["value"]


@pytest.mark.parametrize("machines,local_size", [(2, 1), (1, 2)])
def test_cuda_tensors_on_the_default_path(cluster, machines, local_size):
    """CUDA tensors on the default strategy (owners): copied off the GPU and back per partition
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
