"""byteps.ray on a real local multi-node Ray cluster (ray.cluster_utils.Cluster).

One cluster per module: a head node standing in for a CPU-only machine (no ``gpu_node`` resource) and
two nodes standing in for GPU machines (``gpu_node: 1``). The workers ask for ``gpu_node``, so they land
on the two "GPU" nodes (n = 2), and the plan puts one standalone server on the CPU-only node (k = 1):
Eq. 1-2 give it 2/4 of the model and each colocated server 1/4, hash weights 2 and 1. Everything runs
for real: Ray actors, byteps processes, sockets; sums are compared with locally computed ones.
"""
import functools
import os
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="byteps.ray needs Ray: pip install 'byteps[ray]' (make test installs it)")
torch = pytest.importorskip("torch")

from ray.cluster_utils import Cluster  # noqa: E402

import byteps.ray as bray  # noqa: E402
from byteps import placement  # noqa: E402
from byteps.ray import layout  # noqa: E402

# the worker functions below travel by value (the actors cannot import this test module)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Faster than the defaults, yet not so short that a loaded 2-core machine (Ray starting a node's
# processes) misses a live node's heartbeats: the tests below that kill a process see it go through
# Ray or through its broken links, not through the heartbeats.
FAST = {"BYTEPS_HEARTBEAT_INTERVAL": "0.2", "BYTEPS_HEARTBEAT_TIMEOUT": "10", "BYTEPS_TIMEOUT": "30",
        "OMP_NUM_THREADS": "1"}
GPU = {"gpu_node": 1}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    try:
        gpu_nodes = [c.add_node(num_cpus=2, resources=dict(GPU)) for _ in range(2)]
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes(timeout=60)
        ids = {n.node_id for n in gpu_nodes}
        yield {"gpu": ids, "cpu": {c.head_node.node_id}, "ray": c}
    finally:
        ray.shutdown()
        c.shutdown()


def executor(**kw):
    kw.setdefault("num_workers", 2)
    return bray.RayExecutor(resources_per_worker=GPU, cpus_per_server=0.25, env_vars=FAST, timeout_s=60, **kw)


# ------------------------------------------------------------------ worker functions (run in actors)

def exact_sums(rounds):
    """push_pull of integer-valued tensors of several dtypes and sizes; the sums and the placement."""
    import byteps.torch as bps
    from byteps import common

    bps.init()
    out = {}
    for step in range(rounds):
        for dtype, n in ((torch.float32, 3), (torch.float64, 300_001), (torch.int32, 70_000), (torch.float16, 999)):
            g = torch.Generator().manual_seed(1000 * bps.rank() + step)
            t = torch.randint(-8, 9, (n,), generator=g).to(dtype)
            out[f"{dtype}.{n}.{step}"] = bps.push_pull(t, average=False, name=f"{dtype}.{n}").tolist()
    servers = common.metrics()["servers"]
    info = {"rank": bps.rank(), "size": bps.size(), "sums": out, "weights": [s["weight"] for s in servers],
            "roles": [s["role"] for s in servers], "server_hosts": [s["host"] for s in servers]}
    bps.shutdown()
    return info


def expected_sums(size, rounds):
    want = {}
    for step in range(rounds):
        for dtype, n in ((torch.float32, 3), (torch.float64, 300_001), (torch.int32, 70_000), (torch.float16, 999)):
            total = sum(torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(1000 * r + step))
                        for r in range(size))
            want[f"{dtype}.{n}.{step}"] = total.to(dtype).tolist()
    return want


def data(step, rank=None, size=1):
    """The step's global batch (64 rows), or rank's half of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    y = x @ torch.arange(1.0, 9.0, dtype=torch.float64).unsqueeze(1) + 0.5
    if rank is None:
        return x, y
    rows = slice(rank * 64 // size, (rank + 1) * 64 // size)
    return x[rows], y[rows]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1).double()


def train(steps, distributed):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if distributed:
        import byteps.torch as bps
        bps.init()
        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        x, y = data(step, bps.rank(), bps.size()) if distributed else data(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    if distributed:
        bps.shutdown()
    return params


def push_pull_forever(seconds):
    import byteps.torch as bps

    bps.init()
    t = torch.ones(1000)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        bps.push_pull(t, average=False, name="t")
    bps.shutdown()


def elastic_rounds(outdir, min_rounds):
    """push_pull rounds of integer-valued float32 tensors (exact in any order), checked against their
    closed-form sum, until the driver writes OUTDIR/stop (agreed by a push_pull, so every rank stops
    at the same round). Rank 0 writes the round and the servers (indices) it sent bytes to in it."""
    import json

    import byteps.torch as bps

    bps.init()
    rank, size = bps.rank(), bps.size()
    bad, servers_per_round, step = [], [], 0
    while True:
        stop = os.path.exists(os.path.join(outdir, "stop"))
        if bps.push_pull(torch.tensor([float(stop)]), average=False, name="stop").item() > 0 and step >= min_rounds:
            break
        before = {s["index"]: s["bytes_sent"] for s in bps.metrics()["servers"]}
        for n in (1000, 300_000, 1_200_000):
            base = torch.arange(n, dtype=torch.float32) % 7
            got = bps.push_pull(base * (rank + 1) + step % 5, average=False, name=f"t{n}")
            if not torch.equal(got, base * (size * (size + 1) // 2) + size * (step % 5)):
                bad.append(f"t{n} round {step}")
        used = sorted(s["index"] for s in bps.metrics()["servers"] if s["bytes_sent"] > before.get(s["index"], 0))
        servers_per_round.append(used)
        if rank == 0:
            with open(os.path.join(outdir, "progress.tmp"), "w") as f:
                json.dump({"round": step, "servers": used}, f)
            os.replace(os.path.join(outdir, "progress.tmp"), os.path.join(outdir, "progress"))
        step += 1
    bps.shutdown()
    return {"rounds": step, "bad": bad[:10], "servers_per_round": servers_per_round}


# ------------------------------------------------------------------------------------------ tests

def test_layout_follows_the_plan_on_recorded_clusters():
    def node(i, gpu, cpus=8, ip=None):
        return {"NodeID": f"n{i}", "Alive": True, "NodeManagerAddress": ip or f"10.0.0.{i}",
                "Resources": {"CPU": cpus, **({"GPU": 8} if gpu else {})}}

    nodes = [node(0, True), node(1, True), node(2, True), node(3, True), node(4, False, 16), node(5, False, 96),
             node(6, False, 4)]
    lay, order = layout.plan_layout(nodes, ["n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3"], {"CPU": 1, "GPU": 1})
    assert lay.worker_nodes == ("n0", "n1", "n2", "n3") and lay.local_size == 2 and order == list(range(8))
    assert lay.cpu_nodes == ("n5", "n4", "n6")  # k = 3 <= n = 4, most CPUs first
    assert [s.role for s in lay.servers] == ["colocated"] * 4 + ["standalone"] * 3
    assert lay.hosts["n5"] == "10.0.0.5" and lay.worker_env(5)["DMLC_WORKER_ID"] == "2"
    assert layout.expected_shares(lay) == [placement.shares(4, 3)[1]] * 4 + [placement.shares(4, 3)[0]] * 3
    # more CPU-only nodes than worker nodes: k = n; one worker node: nothing crosses the network, k = 0
    two, _ = layout.plan_layout(nodes, ["n0", "n1"], {"GPU": 1})
    assert len(two.cpu_nodes) == 2
    one, _ = layout.plan_layout(nodes, ["n0"], {"GPU": 1})
    assert one.cpu_nodes == () and one.scheduler_node == "n0"
    # interleaved placement is regrouped by node, machine-major ranks
    lay, order = layout.plan_layout(nodes, ["n1", "n0", "n1", "n0"], {"GPU": 1}, num_cpu_servers=1)
    assert lay.worker_nodes == ("n1", "n0") and order == [0, 2, 1, 3] and lay.cpu_nodes == ("n5",)
    # several Ray nodes on one machine get a loopback address each
    same = [node(i, i < 2, ip="192.0.2.2") for i in range(3)]
    lay, _ = layout.plan_layout(same, ["n0", "n1"], {"GPU": 1})
    assert [lay.hosts[n] for n in ("n0", "n1", "n2")] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    with pytest.raises(ValueError, match="same number of workers on every node"):
        layout.plan_layout(nodes, ["n0", "n0", "n1"], {"GPU": 1})
    with pytest.raises(ValueError, match="num_cpu_servers=4, but the cluster has 3 CPU-only"):
        layout.plan_layout(nodes, ["n0", "n1"], {"GPU": 1}, num_cpu_servers=4)


class Scaler:
    """An executable for RayExecutor.execute: state created once on each worker by start()."""

    def __init__(self, factor):
        self.factor = factor

    def summed(self):
        import byteps.torch as bps

        bps.init()
        out = bps.push_pull(torch.full((4,), float(self.factor * (bps.rank() + 1))), average=False, name="e")
        bps.shutdown()
        return out.tolist()


def test_exact_sums_and_servers_where_the_plan_says(cluster):
    ex = executor()
    try:
        ex.start(executable_cls=Scaler, executable_args=[10])
        assert ex.execute(lambda s: s.summed()) == [[30.0] * 4] * 2
        assert ex.execute_single(lambda s: s.factor, rank=1) == 10
        where = ex.placement()
        assert set(where["workers"]) == cluster["gpu"] and where["scheduler"] in cluster["gpu"]
        roles = {node: role for node, _, role in where["servers"]}
        assert roles == {**{n: "colocated" for n in cluster["gpu"]}, **{n: "standalone" for n in cluster["cpu"]}}
        results = ex.run(exact_sums, args=[2])
        # a second call on the same actors (init after shutdown) also works
        again = ex.run(exact_sums, args=[1])
    finally:
        ex.shutdown()
    want = expected_sums(2, 2)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == 2
        bad = [k for k, v in want.items() if res["sums"][k] != v]
        assert not bad, f"rank {r}: wrong sums for {bad}"
        # Eq. 1-2 with n = 2, k = 1: standalone 2/4, colocated 1/4 each (hash slots 2 and 1)
        by_host = dict(zip(res["server_hosts"], zip(res["roles"], res["weights"])))
        hosts = {node: host for node, host, _ in where["servers"]}
        for node in cluster["gpu"]:
            assert by_host[hosts[node]] == ("colocated", 1)
        (cpu,) = cluster["cpu"]
        assert by_host[hosts[cpu]] == ("standalone", 2)
    assert [a["sums"] for a in again] == [{k: v for k, v in want.items() if k.endswith(".0")}] * 2


def test_training_equals_single_process_training(cluster):
    ex = executor()
    try:
        ex.start()
        results = ex.run(train, args=[6, True])
    finally:
        ex.shutdown()
    local = train(6, False)
    for params in results:
        for got, want in zip(params, local):
            # each worker's mean over half the batch, averaged, is the whole batch's mean gradient
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))


def test_services_the_scheduler_ended_are_started_again(cluster):
    # the scheduler ends a job whose workers all left and then stayed idle for BYTEPS_TIMEOUT (which
    # also bounds the start-up: the workers' actors import torch, a few seconds on a loaded machine)
    ex = bray.RayExecutor(num_workers=2, resources_per_worker=GPU, cpus_per_server=0.25, timeout_s=60,
                          env_vars=dict(FAST, BYTEPS_TIMEOUT="12"))
    try:
        ex.start()
        assert ex.execute(lambda _: exact_sums(1)["sums"]) == [expected_sums(2, 1)] * 2
        first = ex.services.pids()
        deadline = time.monotonic() + 45
        while ex.services.check(allow_clean_exit=True):
            assert time.monotonic() < deadline, "the scheduler did not end the idle job"
            time.sleep(0.5)
        assert ex.execute(lambda _: exact_sums(1)["sums"]) == [expected_sums(2, 1)] * 2
        assert not set(ex.services.pids()) & set(first)  # new processes (pids are handed out in sequence)
    finally:
        ex.shutdown()


def actor_pids(ex):
    return ex.services.pids()


@pytest.mark.parametrize("victim", ["worker 1", "server 2 (standalone)"])
def test_a_killed_actor_is_reported_and_nothing_is_left(cluster, victim):
    import psutil

    ex = executor()
    ex.start()
    workers = list(ex.workers)
    services = [a for _, a, _ in ex.services.actors]
    pids = actor_pids(ex)
    tags = {f"worker {r}": (w, ex.worker_nodes[r]) for r, w in enumerate(ex.workers)}
    tags.update({tag: (a, node) for tag, a, node in ex.services.actors})
    actor, node = tags[victim]
    pgs = [ex._pg.id.hex(), ex.services.pg.id.hex()]
    threading.Timer(3.0, ray.kill, args=(actor,)).start()
    start = time.monotonic()
    with pytest.raises(bray.BytePSRayError) as err:
        ex.run(push_pull_forever, args=[60], timeout_s=90)
    assert time.monotonic() - start < 30
    assert err.value.actor == victim and err.value.node_id == node, str(err.value)
    assert str(err.value).startswith(f"{victim} on node {node[:12]}")
    # no actor, placement group or byteps process of the job is left
    for a in workers + services:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.node_id.remote(), timeout=30)
    table = ray.util.placement_group_table()
    assert all(table[pg]["state"] == "REMOVED" for pg in pgs if pg in table)
    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"byteps service processes {pids} outlived their actors"
        time.sleep(0.1)


def report_sum(config):
    import json

    import byteps.torch as bps

    bps.init()
    total = bps.push_pull(torch.full((5,), float(bps.rank() + 1)), average=False, name="s")
    # Ray 2.60 keeps reported metrics only with a checkpoint: each worker writes its result instead
    with open(os.path.join(config["out"], f"rank{bps.rank()}.json"), "w") as f:
        json.dump({"sum": total.tolist(), "size": bps.size(), "node": ray.get_runtime_context().get_node_id()}, f)
    bps.shutdown()


def test_torch_trainer_with_the_byteps_backend(cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Ray 2.60's TorchTrainer takes the backend configuration as torch_config (DataParallelTrainer: backend_config)
    trainer = TorchTrainer(report_sum, train_loop_config={"out": str(tmp_path)},
                           torch_config=bray.BytePSConfig(cpus_per_server=0.25, env_vars=FAST),
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, **GPU}),
                           run_config=RunConfig(storage_path=str(tmp_path), name="bps"))
    result = trainer.fit()
    assert result.error is None
    import json
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert all(r["sum"] == [3.0] * 5 and r["size"] == 2 for r in res), res
    assert {r["node"] for r in res} == cluster["gpu"]
    # the services' placement group is gone with the run
    assert not [pg for pg in ray.util.placement_group_table().values()
                if pg["name"].endswith("-services") and pg["state"] != "REMOVED"]


def test_node_watcher_keeps_k_at_most_n():
    """The watcher's policy on recorded node tables: CPU-only nodes get servers while k < n (Eq. 6: more
    cannot help), a node that left is forgotten and a spare one takes its place. (The services object
    here only records what it was asked; the real one is exercised by the test below.)"""
    from byteps.ray.elastic import NodeWatcher

    def node(i, alive=True, gpu=False):
        return {"NodeID": f"n{i}", "Alive": alive, "NodeManagerAddress": f"10.0.0.{i}",
                "Resources": {"CPU": 4, **({"gpu_node": 1} if gpu else {})}}

    lay = layout.Layout(worker_nodes=("n0", "n1"), local_size=1, cpu_nodes=("n2",),
                        hosts={"n0": "10.0.0.0", "n1": "10.0.0.1", "n2": "10.0.0.2"}, scheduler_node="n0")

    class Services:
        def __init__(self):
            self.layout, self.timeout, self.serving = lay, 1, {"n2": "server 2 (standalone)"}

        def standalone_nodes(self):
            return set(self.serving)

        def tag_of(self, node):
            return self.serving.get(node)

        def add_server(self, server):
            self.serving[server.node_id] = f"+{server.node_id}@{server.host}"
            return self.serving[server.node_id]

        def drop_server(self, tag):
            self.serving = {n: t for n, t in self.serving.items() if t != tag}

    svc = Services()
    w = NodeWatcher(svc, GPU)
    base = [node(0, gpu=True), node(1, gpu=True), node(2)]
    w.step(base)
    assert w.events == [] and svc.standalone_nodes() == {"n2"}
    w.step(base + [node(3), node(4)])  # k = 1 -> 2 = n: one of the two new nodes only
    assert svc.standalone_nodes() == {"n2", "n3"} and w.events == [("joined", "n3", "+n3@10.0.0.3")]
    w.step([node(0, gpu=True), node(1, gpu=True), node(2), node(3, alive=False), node(4)])  # n3 preempted
    assert svc.standalone_nodes() == {"n2", "n4"}, svc.serving
    assert w.events[1:] == [("left", "n3", "+n3@10.0.0.3"), ("joined", "n4", "+n4@10.0.0.4")]


def _progress(path):
    import json
    try:
        return json.loads((path / "progress").read_text())
    except (OSError, ValueError):
        return {"round": -1, "servers": []}


def _await(what, cond, path, refs, timeout=90):
    """Wait for COND; on a time-out, say where the rounds stood and raise a worker's error if one ended."""
    deadline = time.monotonic() + timeout
    while not cond():
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            ray.get(ref)  # a worker that ended early: its error is the failure
        assert not done, f"waiting for {what}: the workers ended early"
        assert time.monotonic() < deadline, f"timed out waiting for {what}; the rounds at: {_progress(path)}"
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_cpu_server_nodes_join_and_leave_during_training(cluster, tmp_path):
    """elastic_servers=True: a CPU-only node added to the Ray cluster mid-training gets a standalone
    server (index 3) that joins the job. With k = n = 2, Eq. 1-2 give the two standalone servers the
    whole model (a parameter server): the rounds move from servers [0, 1, 2] (1/4, 1/4, 2/4) to
    [2, 3]. Removing that node takes its server away, and training goes on over [0, 1, 2] again.
    Every round's sums are exact, so the results equal an undisturbed run's."""
    ray_cluster = cluster["ray"]
    ex = executor(elastic_servers=True, node_poll_s=0.5).start()
    added = None
    try:
        assert len(ex.placement()["servers"]) == 3  # 2 colocated + the head's standalone (k = 1)
        refs = ex.run_remote(elastic_rounds, [str(tmp_path), 10])
        wait = functools.partial(_await, path=tmp_path, refs=refs)
        wait("3 rounds", lambda: _progress(tmp_path)["round"] >= 3)
        assert ex.watcher.events == []  # no new CPU-only node yet
        added = ray_cluster.add_node(num_cpus=1)
        wait("the new node's server", lambda: any(e[0] == "joined" for e in ex.watcher.events))
        wait("rounds over the standalone servers", lambda: _progress(tmp_path)["servers"] == [2, 3])
        assert ex.watcher.events[0][1] == added.node_id and len(ex.placement()["servers"]) == 4
        ray_cluster.remove_node(added)
        added = None
        wait("the node's departure", lambda: any(e[0] == "left" for e in ex.watcher.events))
        mark = _progress(tmp_path)["round"]
        wait("rounds over servers 0-2", lambda: _progress(tmp_path)["round"] > mark + 2
             and _progress(tmp_path)["servers"] == [0, 1, 2])
        (tmp_path / "stop").touch()
        results = ray.get(refs, timeout=120)
    finally:
        (tmp_path / "stop").touch()
        ex.shutdown()
        if added is not None:
            ray_cluster.remove_node(added)
    for r, res in enumerate(results):
        assert not res["bad"], (r, res["bad"])
        used = res["servers_per_round"]
        assert used[0] == [0, 1, 2] and [2, 3] in used and used[-1] == [0, 1, 2], used
    assert len({res["rounds"] for res in results}) == 1
