"""Worker programs the multi-process tests run: ``python scenarios.py NAME OUTDIR JSON_ARGS``.

Each scenario runs in a real worker process (env set by tests/conftest.py) and writes
``OUTDIR/result.<rank>.json``; the test compares it with a locally computed ground truth.
"""
import json
import os
import sys
import time

import numpy as np
import torch

import byteps.torch as bps

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def seeded(rank, shape, dtype, salt=0):
    """The tensor rank `rank` contributes; the test rebuilds it to compute the expected sum."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype)
    hi = 100 if dtype in (torch.uint8, torch.int8) else 1000
    lo = 0 if dtype == torch.uint8 else -hi
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def digest(t):
    """Exact, JSON-friendly form of a tensor's bytes."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()


@scenario
def sums(out, args):
    """Many tensors of every dtype and shape in flight at once, for several rounds."""
    res = {}
    for rnd in range(args.get("rounds", 2)):
        handles = []
        for spec in args["tensors"]:
            dtype = getattr(torch, spec["dtype"])
            t = seeded(bps.rank(), tuple(spec["shape"]), dtype, salt=rnd)
            h = bps.push_pull_async_inplace(t, average=spec.get("average", False), name=spec["name"])
            handles.append((spec["name"], h))
        for name, h in handles:
            res[f"{name}@{rnd}"] = digest(bps.synchronize(h))
    return res


SCENARIO_NAMES = SCENARIOS


def main():
    name, outdir, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    bps.init()
    result = {"rank": bps.rank(), "size": bps.size(), "local_rank": bps.local_rank(),
              "local_size": bps.local_size()}
    try:
        result["value"] = SCENARIOS[name](outdir, args)
    except Exception as e:  # the test reads the error text
        result["error"] = f"{type(e).__name__}: {e}"
    path = os.path.join(outdir, f"result.{result['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    bps.shutdown()


if __name__ == "__main__":
    main()
