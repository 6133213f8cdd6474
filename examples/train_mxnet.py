"""Data-parallel training of a small Gluon MLP on synthetic data with byteps.mxnet.

Needs the MXNet environment (mxnet 1.9.1 + numpy 1.23.5, docs/mxnet.md): `make mxnet-env`, then

    .venv-mxnet/bin/bpslaunch --local --workers 2 --servers 2 -- .venv-mxnet/bin/python examples/train_mxnet.py

Each worker trains on its own shard of a synthetic regression task (a fixed random "teacher"
plus noise). DistributedTrainer broadcasts rank 0's initial parameters and sums gradients through
the Summation Service, so every worker takes identical steps. Prints the loss (averaged over
workers) per epoch and exits non-zero unless the final parameters are bit-identical everywhere
and the loss went down.
"""
import argparse
import hashlib
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import byteps.mxnet as bps


def make_data(rank, n, dim, seed=0):
    teacher = np.random.RandomState(seed)  # the same teacher everywhere
    w1, w2 = teacher.normal(0, 0.5, (dim, 64)), teacher.normal(0, 0.5, (64, 1))
    rs = np.random.RandomState(seed + 1 + rank)  # a different shard per worker
    x = rs.randn(n, dim)
    y = np.tanh(x @ w1) @ w2 + 0.01 * rs.randn(n, 1)
    return mx.nd.array(x, dtype="float32"), mx.nd.array(y, dtype="float32")


def params_identical(net):
    """Compare every parameter bit for bit with rank 0's; every rank learns the answer."""
    mismatches = 0
    for name, p in sorted(net.collect_params().items()):
        local = p.data().asnumpy()
        root = bps.broadcast_(p.data().copy(), root_rank=0, name=f"check.{name}").asnumpy()
        mismatches += int(local.tobytes() != root.tobytes())
    total = bps.push_pull(mx.nd.array([mismatches], dtype="int32"), average=False, name="check.mismatches")
    return int(total.asscalar()) == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64, help="per worker")
    ap.add_argument("--batches", type=int, default=8, help="batches per epoch per worker")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()

    bps.init()
    mx.random.seed(1234 + bps.rank())  # deliberately different inits: DistributedTrainer broadcasts rank 0's
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(args.hidden, in_units=args.dim, activation="relu"),
            gluon.nn.Dense(args.hidden, in_units=args.hidden, activation="relu"),
            gluon.nn.Dense(1, in_units=args.hidden))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": args.lr, "momentum": 0.9})

    x, y = make_data(bps.rank(), args.batch_size * args.batches, args.dim)
    loss_fn = gluon.loss.L2Loss()
    first = last = None
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        start, total = time.perf_counter(), 0.0
        for b in range(args.batches):
            xb = x[b * args.batch_size:(b + 1) * args.batch_size]
            yb = y[b * args.batch_size:(b + 1) * args.batch_size]
            with autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(args.batch_size)
            total += float(loss.mean().asscalar())
        # the epoch's loss averaged over workers, for printing
        avg = bps.push_pull(mx.nd.array([total / args.batches], dtype="float64"), name="epoch_loss").asscalar()
        first = avg if first is None else first
        last = avg
        rate = args.batch_size * args.batches * bps.size() / (time.perf_counter() - start)
        if bps.rank() == 0:
            print(f"epoch {epoch:2d}  loss {avg:.5f}  {rate:8.0f} samples/s", flush=True)
    elapsed = time.perf_counter() - t0

    same = params_identical(net)
    digest = hashlib.sha256(b"".join(p.data().asnumpy().tobytes()
                                     for _, p in sorted(net.collect_params().items()))).hexdigest()
    if bps.rank() == 0:
        print(f"trained {args.epochs} epochs on {bps.size()} workers in {elapsed:.2f} s; "
              f"loss {first:.5f} -> {last:.5f}")
        print(f"final parameters identical on all {bps.size()} workers: {same} (sha256 {digest[:16]})", flush=True)
    rank = bps.rank()
    bps.shutdown()
    if not same or not last < first:
        raise SystemExit(f"rank {rank}: training check failed (identical={same}, loss {first} -> {last})")


if __name__ == "__main__":
    main()
