"""Scenarios for tests/test_elastic.py: synchronous training that goes on while Summation Service
servers are killed or join (BYTEPS_ELASTIC=1, docs/elastic.md)."""
import os
import time

import torch

import byteps.torch as bps
from scenarios import scenario

#: tensors of a step: (name, elements). 300_000 float32 (1.2 MB) is cut into one piece per server;
#: 1_200_000 (4.8 MB) is two partitions; the small ones are single partitions (direct calls)
TENSORS = (("w.small", 1000), ("w.mid", 300_000), ("w.big", 1_200_000), ("b", 16))
LR = 1.0 / 1024  # a power of two: each update is exact in float32


def gradient(rank, step, numel):
    """Rank ``rank``'s gradient at ``step``: small integers, so every sum is exact whatever its order."""
    return (torch.arange(numel, dtype=torch.float32) % 7) * (rank + 1) + (step % 5)


def gradient_sum(n, step, numel):
    """The sum of every rank's gradient at ``step``, in closed form (cheap: the step time measures
    the communication, not this check)."""
    return (torch.arange(numel, dtype=torch.float32) % 7) * (n * (n + 1) // 2) + n * (step % 5)


def expected_params(n, steps, tensors=TENSORS):
    """The parameters after ``steps`` exact steps of plain SGD with the summed gradients."""
    out = {}
    for name, numel in tensors:
        p = torch.zeros(numel, dtype=torch.float32)
        for step in range(steps):
            p -= LR * gradient_sum(n, step, numel)
        out[name] = p
    return out


@scenario
def elastic_train(out, args):
    """``steps`` steps of SGD on TENSORS, each step's gradients push_pulled (in place and out of place,
    all in flight at once) and checked exactly. Progress goes to OUTDIR/progress.<rank> so the test
    can kill or start servers mid-training; ``sleep`` seconds of "compute" per step. Returns whether
    every step was exact, whether the final parameters equal the locally computed ones, the bytes
    this worker sent to each server per step (the transport's counters) and each step's
    communication time (first submit to last synchronize)."""
    r, n = bps.rank(), bps.size()
    tensors = TENSORS + ((("w.huge", args["big"]),) if args.get("big") else ())  # ``big``: one more, that large
    if args.get("only"):
        tensors = tuple(t for t in tensors if t[0] in args["only"])
    params = {name: torch.zeros(numel, dtype=torch.float32) for name, numel in tensors}
    path = os.path.join(out, f"progress.{r}")
    bad, per_step_bytes, times = [], [], []
    for step in range(args["steps"]):
        before = {s["index"]: s["bytes_sent"] for s in bps.metrics()["servers"]}
        grads = {name: gradient(r, step, numel) for name, numel in tensors}
        mine = gradient(r, step, 1000)
        began = time.perf_counter()
        handles = [(name, bps.push_pull_async_inplace(g, average=False, name=name)) for name, g in grads.items()]
        fresh = bps.push_pull(mine, average=False, name="oop")  # out of place, synchronous
        for name, h in handles:
            bps.synchronize(h)
        times.append(time.perf_counter() - began)
        want_oop = gradient_sum(n, step, 1000)
        if not torch.equal(fresh, want_oop):
            bad.append(f"oop step {step}")
        for name, numel in tensors:
            want = gradient_sum(n, step, numel)
            if not torch.equal(grads[name], want):
                bad.append(f"{name} step {step}")
            params[name] -= LR * grads[name]
        after = {s["index"]: s["bytes_sent"] for s in bps.metrics()["servers"] if s["bytes_sent"]}
        per_step_bytes.append({str(s): after.get(s, 0) - before.get(s, 0) for s in after})
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)
        if args.get("sleep"):
            time.sleep(args["sleep"])
    want = expected_params(n, args["steps"], tensors)
    final = all(torch.equal(params[name], want[name]) for name, _ in tensors)
    return {"bad": bad[:10], "final_exact": final, "bytes": per_step_bytes, "times": times,
            "servers": len(bps.metrics()["servers"]), "results_sent": bps.metrics()["native"]["results_sent"]}
