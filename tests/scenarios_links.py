"""Scenarios for tests/test_links.py: synchronous calls whose round trip runs on the caller's thread
(core/pipeline/bps_worker.h submit_direct), alone, against a late peer, and beside asynchronous traffic."""
import threading
import time

import torch

import byteps.torch as bps
from scenarios import scenario


def _want(numel, n, step, dtype=torch.int64):
    """The exact sum of every rank's ``rank + step`` tensor (integers: no rounding)."""
    return torch.full((numel,), sum(r + step for r in range(n)), dtype=dtype)


@scenario
def direct_calls(out, args):
    """``steps`` synchronous 4 KB push_pulls (in place and out of place); on the steps in
    ``late_steps`` the ranks in ``late_ranks`` sleep first, so the others' direct wait runs out and
    byteps-net must take the partition over. Meanwhile, with ``busy``, a second thread runs
    ``busy_steps`` async multi-partition push_pulls, so direct callers see others' replies on their
    link; its errors are reported in ``bad``.
    Returns whether every result was exact, and the direct-call count."""
    r, n = bps.rank(), bps.size()
    late = set(args.get("late_steps", [])) if r in args.get("late_ranks", []) else set()
    bad = []

    def background():
        # a fixed number of steps on every rank: a loop until this rank's own main loop ended could start
        # one step more on one rank than on another, which then waits for it until BYTEPS_TIMEOUT
        try:
            for k in range(args.get("busy_steps", 40)):
                t = torch.full((300_000,), r + k, dtype=torch.int64)
                bps.synchronize(bps.push_pull_async_inplace(t, average=False, name="busy"))
                if not torch.equal(t, _want(300_000, n, k)):
                    bad.append(f"busy step {k}")
        except Exception as e:  # reported, not lost with the thread
            bad.append(f"busy: {type(e).__name__}: {e}")

    helper = threading.Thread(target=background) if args.get("busy") else None
    if helper is not None:
        helper.start()
    exact = True
    for step in range(args["steps"]):
        if step in late:
            time.sleep(0.05)
        t = torch.full((512,), r + step, dtype=torch.int64)
        bps.push_pull_inplace(t, average=False, name="small")
        out_t = bps.push_pull(torch.full((512,), r + step, dtype=torch.int64), average=False, name="small.oop")
        exact &= torch.equal(t, _want(512, n, step)) and torch.equal(out_t, _want(512, n, step))
    if helper is not None:
        helper.join()
    native = bps.metrics()["native"]
    return {"exact": bool(exact) and not bad, "bad": bad, "direct": native["direct_calls"],
            "adopted": native["direct_adopted"]}
