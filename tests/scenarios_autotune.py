"""Scenarios of tests/test_autotune.py: what partition size and credit a worker ended up with."""
import time

import torch

import byteps.common as common
import byteps.torch as bps
from scenarios import scenario, seeded


@scenario
def tuned(out, args):
    """The agreed values as the worker sees them, and a push_pull cut with them (its sum checked by
    the test: a partition size that differed between workers would fail on the servers)."""
    job = common._job
    got = common.tuning()
    t = seeded(bps.rank(), (args.get("numel", 300_000),), torch.float32)
    started = time.monotonic()
    out_t = bps.push_pull(t, average=False, name="tuned.t")
    took = time.monotonic() - started
    m = bps.metrics()
    tkey = m["tensors"]["tuned.t"]
    parts = job.engine.placement.partitions(tkey, t.numel() * 4, 4)
    # the native core's table of that tensor: cut with the agreed size too (it once kept the
    # placement built before the agreement, with the 4 MB default)
    native = m["partitions"]["tuned.t"]
    return {"tuning": got, "native_pieces": native, "config_partition": common.config().partition_bytes,
            "config_credit": common.config().scheduling_credit,
            "placement_partition": m["partition_bytes"],
            "queue_credit": m["credit_bytes"],
            "pieces": len(parts), "sum": out_t.tolist()[:8], "push_pull_s": took}


@scenario
def credit_crossing(out, args):
    """Two workers whose credit is full of different, less urgent tensors when the most urgent one
    arrives: rank 0 has X on the wire, rank 1 has Z, then both get Y. Each may send Y past its credit
    one partition piece at a time (core/pipeline/bps_queue.h); unless both send the same piece first, each
    server waits for the other worker's piece, which that worker's credit holds back."""
    import byteps.common as common
    from byteps.core import dtypes

    n = args.get("numel", 1 << 16)
    prio = {"X": -1, "Y": 0, "Z": -2}
    bufs = {k: torch.full((n,), float(bps.rank() + 1)) for k in prio}

    def submit(k):
        return common.submit(f"crossing.{k}", bufs[k].view(torch.uint8).numpy(), dtypes.FLOAT32, (n,),
                             priority=prio[k])

    for k in ("X", "Y", "Z"):  # every key declared first, so the next round is not held by declarations
        common.synchronize(submit(k))
    first, later = ("X", "Z") if bps.rank() == 0 else ("Z", "X")
    handles = [submit(first)]
    time.sleep(args.get("gap", 0.5))  # the first tensor fills the credit (the others never send it yet)
    handles += [submit("Y"), submit(later)]
    started = time.monotonic()
    errors = []
    for h in handles:
        try:
            common.synchronize(h)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    size = bps.size()
    want = float(size * (size + 1) // 2) * 2  # the first round's sums plus this round's
    return {"errors": errors, "took_s": time.monotonic() - started,
            "exact": all(bool((b == want).all()) for b in bufs.values())}


@scenario
def tuned_for_model(out, args):
    """A tensor used before the optimizer, then a DistributedOptimizer of a small model: the partition
    size and credit the worker holds before and after, how each tensor was cut, and the sums."""
    before = dict(common.tuning(), credit_bytes=bps.metrics()["credit_bytes"])
    early = seeded(bps.rank(), (300_000,), torch.float32)
    bps.push_pull(early.clone(), average=False, name="early")
    numels = [600_000, 1000, 30_000]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    opt = bps.DistributedOptimizer(torch.optim.SGD(params, lr=0.0),
                                   named_parameters=[(f"w{i}", p) for i, p in enumerate(params)])
    small = torch.nn.Parameter(torch.zeros(10))  # a smaller model later: the larger one still counts
    bps.DistributedOptimizer(torch.optim.SGD([small], lr=0.0), named_parameters=[("small", small)])
    for p in params:
        p.grad = (torch.arange(p.numel()) % 7).float() * (bps.rank() + 1)
    opt.synchronize()
    again = bps.push_pull(early.clone(), average=False, name="early")  # cut as at its first use
    m = bps.metrics()

    def pieces(name):
        return m["partitions"].get(name, [])
    return {"before": before, "after": common.tuning(), "partition_bytes": m["partition_bytes"],
            "credit_bytes": m["credit_bytes"], "grads": [p.grad[:20].tolist() for p in params],
            "grad_pieces": pieces("Gradient.w0"), "early_pieces": pieces("early"), "early": again[:8].tolist()}
