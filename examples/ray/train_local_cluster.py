"""A byteps training job on a local multi-node Ray cluster, with the servers placed by the k/n plan.

    python examples/ray/train_local_cluster.py

Starts three Ray nodes on this machine: two stand in for GPU machines (custom resource ``gpu_node``),
one is CPU-only. RayExecutor puts one worker on each "GPU" node with a colocated Summation Service
server, and a standalone server on the CPU-only node, as Eq. 1-2 of the BytePS paper advise for
n = 2, k = 1 (``bpslaunch --plan --worker-machines 2 --extra 1``). On a real cluster, drop the
Cluster lines, call ``ray.init(address="auto")`` and ask for ``use_gpu=True`` instead.
"""
import ray
from ray.cluster_utils import Cluster

from byteps.ray import RayExecutor


def train(steps):
    import torch
    import byteps.torch as bps

    bps.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(bps.rank())  # each worker its own shard
    x = torch.randn(256, 16, generator=g)
    y = x.sum(1, keepdim=True)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    loss = bps.push_pull(loss.detach(), average=True, name="loss").item()
    result = {"rank": bps.rank(), "loss": loss, "weights": model.weight.detach().clone()}
    bps.shutdown()
    return result


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})   # the CPU-only node
    for _ in range(2):
        cluster.add_node(num_cpus=2, resources={"gpu_node": 1})               # "GPU" nodes
    ray.init(address=cluster.address)
    executor = RayExecutor(num_workers=2, resources_per_worker={"gpu_node": 1}, cpus_per_server=0.5,
                           env_vars={"OMP_NUM_THREADS": "1"})
    try:
        executor.start()
        for node, host, role in executor.placement()["servers"]:
            print(f"{role:>10} server on node {node[:8]} ({host})")
        results = executor.run(train, args=[50])
        for r in results:
            print(f"worker {r['rank']}: final loss {r['loss']:.6f}")
        assert all(r["weights"].equal(results[0]["weights"]) for r in results), "workers diverged"
        print("parameters identical on every worker")
    finally:
        executor.shutdown()
        ray.shutdown()
        cluster.shutdown()
