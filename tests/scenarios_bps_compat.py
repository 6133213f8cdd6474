"""Scenarios for tests/test_bps_compat.py: BytePS's own torch module paths and calls
(``byteps.torch.parallel.DistributedDataParallel``, ``byteps.torch.cross_barrier.CrossBarrier``,
``suspend``/``resume``, ``get_pushpull_speed``). The generators below are shared with the test,
which trains the same models locally as the reference."""
import os
import time

import torch

from scenarios import scenario

import byteps.torch as bps


def ddp_model(rank):
    torch.manual_seed(100 + rank)  # different on every rank: DDP's construction broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 2)).double()


def batch(rank, step, n=5):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return ((model(x) - y) ** 2).sum()


def _ddp(rank, size):
    from byteps.torch.parallel import DistributedDataParallel as DDP

    model = DDP(ddp_model(rank), device_ids=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
    opt.zero_grad()
    with model.no_sync():                 # accumulate locally ...
        loss_of(model, rank, 10).backward()
    loss_of(model, rank, 11).backward()   # ... and reduce the sum with this one
    opt.step()
    return {k: v.tolist() for k, v in model.module.state_dict().items()}


def cb_model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()


def _cross_barrier(rank, size):
    import byteps.torch.cross_barrier as cb

    model = cb_model()
    opt = cb.CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                          named_parameters=model.named_parameters(), num_steps=5)
    cb.broadcast_parameters(model.state_dict(), root_rank=0, prefix="cb.")
    cb.broadcast_optimizer_state(opt, root_rank=0, prefix="cb.opt.")
    for step in range(4):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
    opt.synchronize()  # waits for the last update (no gradients in flight: a no-op push)
    return {"params": {k: v.tolist() for k, v in model.state_dict().items()},
            "is_sgd": isinstance(opt, torch.optim.SGD), "api": [hasattr(cb, n) for n in
                                                                 ("init", "rank", "Compression", "push_pull")]}


def _speed_and_suspend(rank, size):
    res = {"first": list(bps.get_pushpull_speed())}
    t = torch.ones(100000)
    bps.push_pull(t, name="speed.t")
    time.sleep(float(os.environ["BYTEPS_SPEED_WINDOW"]) + 0.05)
    ms, mbps = bps.get_pushpull_speed()
    res["second"] = {"ms_recent": abs(ms - time.time() * 1000) < 60000, "positive": mbps > 0}
    bps.suspend()
    res["suspended"] = bps.is_initialized()
    bps.resume(int(os.environ["DMLC_NUM_WORKER"]), int(os.environ["DMLC_NUM_SERVER"]))
    res["resumed"] = {"rank": bps.rank(), "size": bps.size(),
                      "sum": bps.push_pull(torch.full((3,), float(rank + 1)), average=False,
                                           name="after.resume").tolist()}
    return res


@scenario
def bps_compat_torch(out, args):
    rank, size = bps.rank(), bps.size()
    return {"ddp": _ddp(rank, size), "cross_barrier": _cross_barrier(rank, size),
            "speed": _speed_and_suspend(rank, size)}


@scenario
def bps_tiny(out, args):
    """One push_pull and one broadcast (for jobs whose services were started some other way)."""
    rank = bps.rank()
    return {"sum": bps.push_pull(torch.arange(4, dtype=torch.float64) * (rank + 1), average=False,
                                 name="tiny").tolist(),
            "bcast": bps.broadcast_(torch.full((2,), float(rank)), root_rank=1, name="tiny.b").tolist()}
