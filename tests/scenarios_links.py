"""Scenarios for tests/test_links.py: synchronous calls whose round trip runs on the caller's thread
(core/pipeline/bps_worker.h submit_direct), alone, against a late peer, and beside asynchronous traffic."""
import os
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


@scenario
def late_reply(out, args):
    """After a first push_pull of a 4 MB tensor on both ranks (its name declared), rank 1 calls again
    ``args["delay"]`` s late, after rank 0's push_pull of the same tensor failed
    by BYTEPS_TIMEOUT; rank 0 then fills its tensor with 7 and waits for rank 1's call to end (which
    makes the server send rank 0 its late reply too). Returns rank 0's error, whether its tensor still
    holds only 7s (the late sum was not read into it), what rank 1 got, and the metrics' count of
    replies read straight into a tensor."""
    r = bps.rank()
    done = f"{out}/late_reply.done"
    t = torch.full((1 << 20,), r + 1, dtype=torch.int32)
    bps.push_pull(t, average=False, name="late")
    if r == 1:
        time.sleep(args["delay"])
        bps.push_pull_inplace(t, average=False, name="late")
        with open(done, "w"):
            pass
        time.sleep(3)  # rank 0 reads its link meanwhile
        return {"got": sorted(set(t.tolist())), "in_place": bps.metrics()["native"]["replies_in_place"]}
    try:
        bps.push_pull_inplace(t, average=False, name="late")
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    t.fill_(7)
    deadline = time.monotonic() + 2 * args["delay"]
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # the late reply reaches byteps-net, which drops it
    return {"error": error, "kept": bool(torch.equal(t, torch.full_like(t, 7))),
            "rank1_done": os.path.exists(done), "in_place": bps.metrics()["native"]["replies_in_place"]}
