"""Scenarios for the native local reduce (core/pipeline/bps_worker.h, tests/test_native_core.py)."""
import time

import torch

from scenarios import scenario

import byteps.torch as bps


@scenario
def local_rank_missing(out, args):
    """Local rank 1 never calls push_pull (it sleeps past the time-out): every other process's
    push_pulls must time out naming it, a multi-partition tensor and a one-partition one."""
    shapes = (("multi", (3, 1001)), ("one", (3,)))
    for name, shape in shapes:  # declared by everyone (a missing declaration is another time-out)
        bps.push_pull(torch.ones(shape), average=False, name=name)
    if bps.local_rank() == 1:
        time.sleep(args["sleep"])
        return {}
    got = {}
    for name, shape in shapes:
        try:
            bps.push_pull(torch.ones(shape), average=False, name=name)
            got[name] = "no error"
        except Exception as e:
            got[name] = f"{type(e).__name__}: {e}"
    return got
