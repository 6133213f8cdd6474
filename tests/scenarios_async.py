"""Asynchronous-training scenarios (BYTEPS_ENABLE_ASYNC=1), checked by tests/test_async.py."""
import time

import torch

import byteps.torch as bps
from scenarios import digest, scenario

LR = 0.5  # a power of two: every update below is exact in float64


def targets(rank, step, numel):
    """Worker `rank`'s target at its `step`-th update: small integers, so w - t stays dyadic."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randint(-8, 9, (numel,), generator=g).to(torch.float64)


def initial(rank, numel):
    """Every rank starts from different values; the servers must adopt rank 0's."""
    return torch.arange(numel, dtype=torch.float64) * (rank + 1) - 3 * rank


def _pull_latest(opt, w):
    """A zero update: the servers answer with their current parameters."""
    w.grad = torch.zeros_like(w)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    opt.param_groups[0]["lr"] = lr
    return w.detach().clone()


@scenario
def async_schedule(out, args):
    """Theorem 2: updates applied in a scripted order (a barrier between turns). Loss 0.5|w - t|^2."""
    numel, schedule = args["numel"], args["schedule"]
    me = bps.rank()
    w = torch.nn.Parameter(initial(me, numel))
    opt = bps.DistributedOptimizer(torch.optim.SGD([w], lr=LR), named_parameters=[("w", w)])
    start = w.detach().clone()
    steps = 0
    for who in schedule:
        if who == me:
            opt.zero_grad()
            loss = 0.5 * ((w - targets(me, steps, numel)) ** 2).sum()
            loss.backward()
            opt.step()
            steps += 1
        bps.barrier()
    final = _pull_latest(opt, w) if me == 0 else None
    bps.barrier()
    return {"start": digest(start), "final": None if final is None else digest(final), "steps": steps}


@scenario
def async_pace(out, args):
    """Workers step freely for a fixed time; one sleeps each step. Reports steps made."""
    w = torch.nn.Parameter(torch.zeros(args["numel"], dtype=torch.float64))
    opt = bps.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)])
    bps.barrier()
    sleep = args["sleep"] if bps.rank() == args["slow_rank"] else 0.0
    steps, deadline = 0, time.monotonic() + args["seconds"]
    while time.monotonic() < deadline:
        w.grad = torch.ones_like(w)
        opt.step()
        steps += 1
        time.sleep(sleep)
    bps.barrier()
    return {"steps": steps}


@scenario
def async_no_lost_update(out, args):
    """Every worker pushes random integer deltas concurrently (no barrier); returns their sum."""
    numel, me = args["numel"], bps.rank()
    w = torch.nn.Parameter(initial(me, numel))
    opt = bps.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)])
    start = w.detach().clone()
    total = torch.zeros(numel, dtype=torch.float64)
    g = torch.Generator().manual_seed(31 + me)
    bps.barrier()
    for _ in range(args["steps"]):
        delta = torch.randint(-1000, 1001, (numel,), generator=g).to(torch.float64)
        w.grad = -delta          # SGD with lr 1: w + delta, exact for integers
        opt.step()
        total += delta
    bps.barrier()                # every delta is in: the servers' state is final
    final = _pull_latest(opt, w)
    return {"start": digest(start), "total": digest(total), "final": digest(final)}
