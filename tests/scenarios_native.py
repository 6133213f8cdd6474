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


@scenario
def lazy_delivery(out, args):
    """Who finishes a native op (its event, its callbacks) once the native core has it done: the caller
    that polls and synchronizes (the completion thread waits BPS_LAZY_DELIVERY_S before taking the GIL
    for it), the completion thread when nobody takes it, and the completion thread at once for an op
    with a done callback (Engine.prompt). Every sum checked exactly."""
    import threading
    import time

    import byteps.common as common
    from byteps.torch import completion

    r, n = bps.rank(), bps.size()
    job = common._job
    core = job.engine._native
    want = float(sum(q + 1 for q in range(n)))
    for name in ("lazy.a", "lazy.b", "lazy.c"):  # declared: later calls go straight to the native core
        bps.push_pull_inplace(torch.ones(1000), average=False, name=name)
    sums_ok = True

    late = core.lazy_late
    by_caller = 0
    for _ in range(args.get("polled", 20)):
        x = torch.full((1000,), float(r + 1))
        h = bps.push_pull_async_inplace(x, average=False, name="lazy.a")
        op = job.handles[h][0]
        while not bps.poll(h):  # a training thread busy with Python
            pass
        by_caller += not op.done.is_set()  # nobody finished it yet: this thread will
        bps.synchronize(h)
        sums_ok &= bool(torch.equal(x, torch.full((1000,), want)))
    late_polled, late = core.lazy_late - late, core.lazy_late

    x = torch.full((1000,), float(r + 1))
    h = bps.push_pull_async_inplace(x, average=False, name="lazy.b")
    op = job.handles[h][0]
    deadline = time.monotonic() + 10
    while not op.done.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    alone = op.done.is_set() and "lazy.b" not in job.inflight  # its callbacks ran too
    bps.synchronize(h)
    sums_ok &= bool(torch.equal(x, torch.full((1000,), want)))
    late_alone, late = core.lazy_late - late, core.lazy_late

    x = torch.full((1000,), float(r + 1))
    called = threading.Event()
    if r == n - 1:  # the last rank comes late: the others' ops finish well after their when_done()
        time.sleep(0.3)
    h = bps.push_pull_async_inplace(x, average=False, name="lazy.c")
    completion.when_done([h], lambda outcomes: called.set())
    callback = called.wait(10)
    sums_ok &= bool(torch.equal(x, torch.full((1000,), want)))
    late_callback, late = core.lazy_late - late, core.lazy_late

    # new names: the engine thread declares them and submits them to the native core, while the caller
    # may already wait on their events: never lazy (each once waited out BPS_LAZY_DELIVERY_S)
    xs = [torch.full((1000,), float(r + 1)) for _ in range(5)]
    hs = [bps.push_pull_async_inplace(x, average=False, name=f"lazy.new.{i}") for i, x in enumerate(xs)]
    for h in hs:
        bps.synchronize(h)
    sums_ok &= all(bool(torch.equal(x, torch.full((1000,), want))) for x in xs)
    return {"by_caller": by_caller, "late_polled": late_polled, "alone": alone, "late_alone": late_alone,
            "callback": callback, "late_callback": late_callback, "late_declared": core.lazy_late - late,
            "sums_ok": sums_ok}
