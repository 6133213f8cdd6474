"""Call patterns of training scripts (tests/scenarios_calls.py): unnamed synchronous calls reuse one
key, out-of-place results come from byteps's host pool without page faults and are never reused
while held, a name is free again as soon as it is synchronized."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import Run  # noqa: E402

N = 2


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("calls"), "torch_calls", N, 1)


@pytest.mark.timeout(150)
def test_results_are_right_and_held_results_are_never_reused(calls):
    for r in range(N):
        v = calls.value(r)
        sums = [sum(rank + 1 + step for rank in range(N)) for step in range(4)]
        assert v["oop"] == sums + sums
        assert v["inplace"] == sums
        assert v["distinct_storage"]
        assert v["view_kept"] == [float(sum(range(N))), 100.0 * N]
        assert v["again"]


@pytest.mark.timeout(150)
def test_warm_out_of_place_loop_reuses_pooled_memory(calls):
    for r in range(N):
        v = calls.value(r)
        assert v["pool"]["allocated"] == 0 and v["pool"]["reused"] == 10, v["pool"]
        assert v["faults_per_call"] < 16, v  # a fresh 1 MB result would take 256


@pytest.mark.timeout(150)
def test_unnamed_sync_calls_share_one_name(calls):
    v = calls.value(0)
    assert v["sync_name"].startswith("push_pull.sync.float32.")
    assert v["new_keys"] == 1, v  # eight unnamed calls (out of place and in place) of one shape: one key
    assert len(set(map(str, calls.values("async")))) == 1  # numbered async names still agree across ranks


def test_host_pool_gives_blocks_back_only_when_free():
    import gc

    import numpy as np
    import torch

    from byteps.buffers import PAGE, HostPool

    pool = HostPool(max_free_bytes=3 << 20)
    a = torch.from_numpy(pool.take(1 << 20))
    a.fill_(7)
    view = a[10:20]
    del a
    gc.collect()
    assert pool.free_bytes() == 0  # the view still holds the block
    b = torch.from_numpy(pool.take(1 << 20))
    assert pool.allocated == 2 and (view == 7).all()
    del view, b
    gc.collect()
    assert pool.free_bytes() == 2 << 20
    c = pool.take((1 << 20) - 5)  # same page-rounded size: reused
    assert pool.reused == 1 and c.size == (1 << 20) - 5 and c.ctypes.data % PAGE == 0
    del c
    big = [pool.take(2 << 20) for _ in range(2)]
    del big
    gc.collect()
    assert pool.free_bytes() <= 3 << 20  # the cap: a block beyond it is freed, not kept
    assert isinstance(pool.take(4096), np.ndarray)


@pytest.mark.timeout(120)
def test_push_pull_is_differentiable_only_where_autograd_needs_it(tmp_path):
    """A tensor that requires grad gets a grad_fn and a push_pulled gradient; a plain tensor, or any
    tensor under no_grad(), skips autograd's Function (a tenth of a 4 KB call) with the same sum."""
    run = Run(tmp_path, "push_pull_gradients", N, 1)
    for r in range(N):
        assert run.value(r) == {"tracked": True, "sum": True, "grad": True, "plain_tracked": False,
                                "plain_sum": True, "no_grad_tracked": False, "no_grad_sum": True}, run.value(r)
