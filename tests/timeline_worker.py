"""A training-like job for tests/test_timeline.py and bench/bench_timeline.py: a few tensors of mixed
sizes push_pulled each step, checked against the exact sum, a step marked after each.

    python timeline_worker.py STEPS [--die-after N] [--start-timeline PATH --stop-after N] [--sleep S]
"""
import argparse
import os
import signal
import time

import torch

import byteps.torch as bps

p = argparse.ArgumentParser()
p.add_argument("steps", type=int)
p.add_argument("--die-after", type=int, default=None, help="rank 1 kills itself (SIGKILL) after this step")
p.add_argument("--start-timeline", default=None, help="call start_timeline(PATH) after step 1")
p.add_argument("--stop-after", type=int, default=None, help="call stop_timeline() after this step")
p.add_argument("--sleep", type=float, default=0.0, help="seconds of 'computation' per step")
p.add_argument("--sizes", default="1000,300000,1500000", help="tensor sizes in float32 elements")
p.add_argument("--times", default=None, help="write the step times (seconds, one a line) here")
opts = p.parse_args()

bps.init()
tensors = [torch.empty(int(n)) for n in opts.sizes.split(",")]
expect = sum(r + 1 for r in range(bps.size()))
times = []
for step in range(1, opts.steps + 1):
    began = time.perf_counter()
    if opts.sleep:
        time.sleep(opts.sleep)
    handles = []
    for i, t in enumerate(tensors):
        t.fill_(bps.rank() + 1)
        handles.append(bps.push_pull_async_inplace(t, name=f"layer{i}", average=False))
    for h, t in zip(handles, tensors):
        bps.synchronize(h)
        assert t[0].item() == expect and t[-1].item() == expect, (t[0].item(), expect)
    bps.mark_step()
    times.append(time.perf_counter() - began)
    if opts.start_timeline and step == 1:
        bps.start_timeline(opts.start_timeline)
    if opts.stop_after == step:
        bps.stop_timeline()
    if opts.die_after == step and bps.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
if opts.times:
    with open(f"{opts.times}.{bps.rank()}", "w") as f:
        f.write("\n".join(f"{t:.6f}" for t in times))
bps.shutdown()
