"""Worker scenarios for the stress tests (tests/test_stress.py, tests/test_fuzz_stress.py,
tests/test_big_tensors.py). Loaded by tests/scenarios.py like every ``scenarios_*.py``.

Every value pushed here is a small integer, so every sum is exact in every dtype and each rank
can check its results against a locally computed sum without a tolerance.
"""
import hashlib
import os
import time

import numpy as np
import torch

from scenarios import scenario

import byteps.torch as bps

#: (name, elements, dtype) pushed every step of stress_loop: one partition, several, many
STRESS_TENSORS = [("tiny", 7, torch.float32), ("ints", 30001, torch.int64), ("grads", 100003, torch.float32),
                  ("big", 400000, torch.float32)]


def _contribution(seed, rank, name, numel, dtype):
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + sum(name.encode()))
    return torch.randint(-50, 51, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _progress(out, rank, step):
    """OUTDIR/progress.<rank> holds the number of finished steps (and the pid, for the launcher tests)."""
    path = os.path.join(out, f"progress.{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{step} {os.getpid()}")
    os.replace(path + ".tmp", path)


@scenario
def stress_loop(out, args):
    """push_pull a mix of tensors, every step checked exactly, until a peer is lost (or max_steps,
    a number every rank reaches, unlike a time limit). With "priorities", the tensors have
    different priorities (0, 1, 2), as a DistributedOptimizer's layers do.

    Returns {"steps", "error_type", "error"}: the test kills a process at a random moment and
    reads here what the survivors were told.
    """
    r, n, seed = bps.rank(), bps.size(), args["seed"]
    parts = {name: [_contribution(seed, q, name, numel, dtype) for q in range(n)]
             for name, numel, dtype in STRESS_TENSORS}
    expected = {name: torch.stack(ts).sum(0).to(ts[0].dtype) for name, ts in parts.items()}
    step = 0
    while step < args.get("max_steps", 10 ** 6):
        try:
            work = [(name, parts[name][r].clone()) for name in parts]
            handles = [(name, t, bps.push_pull_async_inplace(t, average=False, name=name,
                                                              priority=i % 3 if args.get("priorities") else 0))
                       for i, (name, t) in enumerate(work)]
            for name, t, h in handles:
                bps.synchronize(h)
                if not torch.equal(t, expected[name]):
                    bad = int((t != expected[name]).sum())
                    return {"steps": step, "error_type": "WrongSum",
                            "error": f"step {step}: {name} differs from the local sum in {bad} elements"}
        except Exception as e:  # the test reads what the survivors were told
            return {"steps": step, "error_type": type(e).__name__, "error": str(e)}
        step += 1
        _progress(out, r, step)
    return {"steps": step, "error_type": None, "error": None}


@scenario
def wait_then_sum(out, args):
    """Push one tensor, then wait for OUTDIR/go (the test fuzzes the server meanwhile), then push
    more; every sum is checked exactly against the locally computed one."""
    r, n = bps.rank(), bps.size()
    spec = [("before", 1000, torch.int64), ("after", 250001, torch.float32), ("after_i", 1237, torch.int32)]
    parts = {name: [_contribution(11, q, name, numel, dtype) for q in range(n)] for name, numel, dtype in spec}
    got = {}

    def one(name):
        t = parts[name][r].clone()
        bps.push_pull_inplace(t, average=False, name=name)
        got[name] = bool(torch.equal(t, torch.stack(parts[name]).sum(0).to(t.dtype)))

    one("before")
    _progress(out, r, 1)
    go = os.path.join(out, "go")
    deadline = time.monotonic() + args.get("wait", 120)
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError("the test never wrote OUTDIR/go")
        time.sleep(0.05)
    for _ in range(args.get("rounds", 3)):
        one("after")
        one("after_i")
    return got


def big_values(rank, start, stop, dtype):
    """Elements [start, stop) of rank `rank`'s big tensor: small integers from the index (exact sums)."""
    i = np.arange(start, stop, dtype=np.int64)
    if dtype == np.uint8:
        return ((i * (2 * rank + 3) + rank) % 251).astype(np.uint8)  # sums wrap mod 256, like numpy's
    return (((i * (2 * rank + 3) + 5 * rank) % 61) - 30).astype(dtype)


@scenario
def big_tensor(out, args):
    """One push_pull of a tensor over 2 GiB; the result is compared with the locally computed sum
    chunk by chunk (np.array_equal) and its sha256 is returned for the test to check again."""
    import resource

    r, n = bps.rank(), bps.size()
    dtype = np.dtype(args["dtype"])
    numel = args["numel"]
    chunk = 1 << 24  # elements per vectorised step (index temporaries of 128 MiB)
    arr = np.empty(numel, dtype=dtype)
    for lo in range(0, numel, chunk):
        hi = min(numel, lo + chunk)
        arr[lo:hi] = big_values(r, lo, hi, dtype)
    t = torch.from_numpy(arr)  # shares arr's memory: no second copy
    start = time.monotonic()
    bps.push_pull_inplace(t, average=False, name="big")
    elapsed = time.monotonic() - start
    equal = True
    h = hashlib.sha256()
    for lo in range(0, numel, chunk):
        hi = min(numel, lo + chunk)
        want = big_values(0, lo, hi, dtype)
        for q in range(1, n):
            want = want + big_values(q, lo, hi, dtype)  # same dtype: uint8 wraps like the server's sum
        equal = equal and np.array_equal(arr[lo:hi], want.astype(dtype))
        h.update(memoryview(arr[lo:hi]))
    return {"equal": bool(equal), "sha256": h.hexdigest(), "seconds": elapsed,
            "nbytes": int(arr.nbytes), "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


@scenario
def crossed_orders(out, args):
    """push_pull tensors x and y in an order that differs between machines: machine 0's processes
    queue x then y, machine 1's y then x. With "crossed_priorities", the tensor a process queues first
    is also its most urgent one, so the workers disagree on urgency too. Every sum checked exactly.

    Returns {"steps", "credit_stalls"}: how often a send queue's head had to go past a stalled credit.
    """
    import byteps.common as common

    r, n = bps.rank(), bps.size()
    machine = r // bps.local_size()
    numel = args.get("numel", 100_000)
    names = ["x", "y"] if machine % 2 == 0 else ["y", "x"]
    for name in ("x", "y"):  # declared once, in one order: every later call goes straight to the queue
        bps.push_pull_inplace(torch.ones(numel), average=False, name=name)
    steps = args.get("steps", 5)
    for step in range(steps):
        tensors = {name: torch.full((numel,), float(r + 1 + (name == "y"))) for name in names}
        handles = [(name, bps.push_pull_async_inplace(tensors[name], average=False, name=name,
                                                      priority=(1 - k) if args.get("crossed_priorities") else 0))
                   for k, name in enumerate(names)]
        for name, h in handles:
            bps.synchronize(h)
            want = float(sum(q + 1 + (name == "y") for q in range(n)))
            assert torch.equal(tensors[name], torch.full((numel,), want)), (step, name, tensors[name][:4])
    return {"steps": steps, "credit_stalls": common.metrics()["credit_stalls"]}
