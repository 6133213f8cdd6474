"""Unmodified PyTorch DistributedDataParallel, with byteps as the torch.distributed backend.

    bpslaunch --local --workers 2 --servers 2 -- python examples/train_ddp.py
    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py

``import byteps.torch`` registers the backend "byteps"; after that the script is plain DDP.
Under torchrun the usual env:// rendezvous works (and rank 0 starts byteps' scheduler and server
itself, see docs/launchers.md); under bpslaunch there is no MASTER_ADDR, so the script uses the
"byteps://" rendezvous, which takes rank and world size from the byteps job.

The data is synthetic (regression against a fixed random teacher). At the end every worker checks
that its parameters are bit-identical to every other worker's; the script exits with status 1 otherwise.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import byteps.torch  # noqa: F401  (registers the "byteps" backend)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    init_method = None if "MASTER_ADDR" in os.environ else "byteps://"
    dist.init_process_group(backend="byteps", init_method=init_method)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different inits on purpose: DDP broadcasts rank 0's at construction
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset)  # num_replicas and rank from the default group
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(xb), len(xb)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: loss {total[0].item() / total[1].item():.5f} ({world} workers, "
                  f"backend {dist.get_backend()})", flush=True)

    # every worker must hold the same parameters, bit for bit
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.state_dict().values()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    if rank == 0:
        print("final parameters identical on all workers" if same else "FAILED: parameters differ across workers",
              flush=True)
    dist.destroy_process_group()
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
