"""Asynchronous data-parallel training (BYTEPS_ENABLE_ASYNC=1) of a small MLP on synthetic data.

    BYTEPS_ENABLE_ASYNC=1 bpslaunch --local --workers 2 --servers 2 -- python examples/train_async.py

The servers keep the parameters (initialised from rank 0's); each worker steps at its own pace,
pushing its parameter update and continuing from the servers' latest parameters, with no barrier
between workers (docs/async.md). Each worker prints its first and final loss on its own shard.
"""
import argparse
import time

import torch

import byteps.torch as bps
from train_synthetic import make_data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    bps.init()
    torch.manual_seed(1234 + bps.rank())  # different inits: the servers adopt rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters())
    x, y = make_data(bps.rank(), args.batch_size * 8, args.dim)
    loss_fn = torch.nn.MSELoss()
    first = None
    t0 = time.perf_counter()
    for step in range(args.steps):
        lo = (step % 8) * args.batch_size
        opt.zero_grad()
        loss = loss_fn(model(x[lo:lo + args.batch_size]), y[lo:lo + args.batch_size])
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    with torch.no_grad():
        final = loss_fn(model(x), y).item()
    print(f"first loss rank {bps.rank()} {first:.6f}", flush=True)
    print(f"final loss rank {bps.rank()} {final:.6f}", flush=True)
    print(f"rank {bps.rank()}: {args.steps} asynchronous steps in {time.perf_counter() - t0:.2f} s", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
