"""Data-parallel training of a small MLP on synthetic data with byteps.

Run it on one machine with 2 workers and 2 Summation Service servers:

    bpslaunch --local --workers 2 --servers 2 -- python examples/train_synthetic.py

Each worker trains on its own shard of a synthetic regression task (a fixed random "teacher"
network plus noise); gradients are averaged through the Summation Service, so every worker
takes identical steps. Prints loss and samples/s per step, and checks at the end that the
final parameters are bit-identical on every worker.
"""
import argparse
import hashlib
import time

import torch

import byteps.torch as bps


def make_data(rank, n, dim, seed=0):
    teacher = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    torch.manual_seed(seed)  # the same teacher everywhere
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.5)
    g = torch.Generator().manual_seed(seed + 1 + rank)  # a different shard per worker
    x = torch.randn(n, dim, generator=g)
    with torch.no_grad():
        y = teacher(x) + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=256, help="per worker")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    bps.init()
    torch.manual_seed(1234 + bps.rank())  # deliberately different inits: broadcast_parameters fixes that
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)

    x, y = make_data(bps.rank(), args.batch_size * 8, args.dim)
    loss_fn = torch.nn.MSELoss()
    first_loss = None
    t0 = time.perf_counter()
    for step in range(args.steps):
        lo = (step % 8) * args.batch_size
        xb, yb = x[lo:lo + args.batch_size], y[lo:lo + args.batch_size]
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        # the loss averaged over workers, for printing
        avg = bps.push_pull(loss.detach(), average=True, name="loss").item()
        first_loss = first_loss if first_loss is not None else avg
        rate = args.batch_size * bps.size() / (time.perf_counter() - start)
        if bps.rank() == 0:
            print(f"step {step:3d}  loss {avg:.5f}  {rate:8.0f} samples/s", flush=True)
    elapsed = time.perf_counter() - t0

    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests = bps.allgather_object(digest)
    same = len(set(digests)) == 1
    if bps.rank() == 0:
        print(f"trained {args.steps} steps on {bps.size()} workers in {elapsed:.2f} s "
              f"({args.steps * args.batch_size * bps.size() / elapsed:.0f} samples/s); "
              f"loss {first_loss:.5f} -> {avg:.5f}")
        print(f"final parameters identical on all {bps.size()} workers: {same} (sha256 {digest[:16]})")
    bps.shutdown()
    if not same or not avg < first_loss:
        raise SystemExit(f"rank {bps.rank() if bps.is_initialized() else '?'}: training check failed "
                         f"(identical={same}, loss {first_loss} -> {avg})")


if __name__ == "__main__":
    main()
