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
    tkey = next(k for (name, _), k in job.engine._keys.items() if name == "tuned.t")
    parts = job.engine.placement.partitions(tkey, t.numel() * 4, 4)
    return {"tuning": got, "config_partition": common.config().partition_bytes,
            "config_credit": common.config().scheduling_credit,
            "placement_partition": job.engine.placement.partition_bytes,
            "queue_credit": job.engine._sendq.credit,
            "pieces": len(parts), "sum": out_t.tolist()[:8], "push_pull_s": took}
