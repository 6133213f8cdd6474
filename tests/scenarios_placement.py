"""Worker scenarios of tests/test_placement.py and tests/test_emulated_cluster.py: push_pull under the
k/n placements, and balanced fusion buffers (byteps/fusion.py)."""
import random

import numpy as np
import torch

import byteps.torch as bps
import byteps.common as bps_common
from byteps.fusion import FusedPushPull
from scenarios import digest, scenario

# realistic mixed sizes: biases, norms, small and large weights, odd lengths (not multiples of 64 bytes)
SHAPES = [(7,), (64,), (3, 3, 3, 16), (1000,), (257, 129), (4096, 33), (12345,), (2,), (300_001,)]
DTYPES = ["float32", "float64", "int32", "float16", "bfloat16", "int64", "uint8", "float32", "float32"]


def seeded(rank, shape, dtype, salt=0):
    """Small integers in every dtype: their sums are exact in any order (fp16 included), so the
    result does not depend on which server adds which push first."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    lo = 0 if dtype == torch.uint8 else -8
    return torch.randint(lo, 9, shape, generator=g, dtype=torch.int64).to(dtype)


def _engine_info():
    m = bps_common.metrics()
    return {"weights": [s["weight"] for s in m["servers"]], "mode": m["placement_mode"],
            "roles": [s["role"] for s in m["servers"]]}


@scenario
def placed(out, args):
    """Tensors of many sizes and dtypes for several rounds; returns exact digests and the placement."""
    res = {}
    for rnd in range(args.get("rounds", 2)):
        handles = []
        for i, (shape, dt) in enumerate(zip(SHAPES, DTYPES)):
            t = seeded(bps.rank(), shape, getattr(torch, dt), salt=rnd * 100 + i)
            handles.append((f"t{i}", bps.push_pull_async_inplace(t, average=False, name=f"t{i}")))
        for name, h in handles:
            res[f"{name}@{rnd}"] = digest(bps.synchronize(h))
    b = torch.zeros(5000) if bps.rank() else torch.arange(5000, dtype=torch.float32)
    res["broadcast"] = digest(bps.broadcast_(b, root_rank=0, name="bcast"))
    return {"sums": res, "placement": _engine_info()}


@scenario
def fused(out, args):
    """FusedPushPull over mixed dtypes for several steps, handing tensors over in a different random
    order on every rank and step (Herring: placement must not depend on it)."""
    steps = args.get("steps", 3)
    fusion = FusedPushPull("grads", buffer_bytes=args.get("buffer_bytes"))
    rng = random.Random(bps.rank())
    res = {}
    for step in range(steps):
        tensors = {f"g{i}": seeded(bps.rank(), shape, getattr(torch, dt), salt=step * 100 + i)
                   for i, (shape, dt) in enumerate(zip(SHAPES, DTYPES))}
        names = list(tensors)
        rng.shuffle(names)
        for name in names:
            t = tensors[name]
            fusion.add(name, t.view(-1).view(torch.uint8).numpy(), _dtype_code(t))
        fusion.synchronize()
        for name, t in tensors.items():
            res[f"{name}@{step}"] = digest(t)
    layout = fusion.layout
    res["buffers"] = [[int(d), int(n)] for d, n in layout.buffers]
    res["runs"] = {k: [list(r) for r in v] for k, v in layout.runs.items()}
    try:  # the fused set is fixed after step 1: a new tensor is refused with its name
        fusion.add("new", np.zeros(8, dtype=np.uint8), 6)
        res["new"] = "no error"
    except ValueError as e:
        res["new"] = str(e)
    return {"sums": res, "placement": _engine_info()}


def _dtype_code(t):
    from byteps.core import dtypes

    return dtypes.from_name(str(t.dtype))


def expected(n, steps, kind):
    """Locally computed sums the scenarios must reproduce exactly."""
    out = {}
    for i, (shape, dt) in enumerate(zip(SHAPES, DTYPES)):
        dtype = getattr(torch, dt)
        for step in steps:
            total = sum(seeded(r, shape, dtype, salt=step * 100 + i).to(torch.int64) for r in range(n))
            out[f"{kind}{i}@{step}"] = digest(total.to(dtype))
    return out
