"""Scenarios for tests/test_native_server.py: broadcasts of every dtype through the server."""
import torch

import byteps.torch as bps
from scenarios import digest, scenario, seeded

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.int8]


@scenario
def native_broadcasts(out, args):
    """Each dtype broadcast from every root, in sizes below and above one partition, twice (two rounds
    of the same keys); every rank reports whether it got the root's exact bytes."""
    r, n = bps.rank(), bps.size()
    got = {}
    for rnd in range(2):
        for dtype in DTYPES:
            for numel in (3, 700):
                for root in range(n):
                    t = seeded(r, (numel,), dtype, salt=rnd)
                    want = seeded(root, (numel,), dtype, salt=rnd)
                    bps.broadcast_(t, root, name=f"b.{dtype}.{numel}.{root}")
                    got[f"{dtype}.{numel}.{root}@{rnd}"] = digest(t) == digest(want)
    return got
