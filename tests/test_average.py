"""Averages (users' default: ``push_pull(t)`` and Horovod's ``allreduce(t)`` average): the native
core divides each partition's sum as it copies it into the tensor (bps_divide_copy), with no pass of its
own. Results must be bit-identical to the sum divided by torch's ``div_`` (floor division for
integers), with 3 workers so that the division rounds, over servers and through a machine's local
reduce, for one partition (the caller's direct path) and many (from 1 MB: the streamed copy)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# 1000 elements: one partition; 600,000: several (4 MB partitions hold 1M float32, so fp16's 1.2 MB splits
# only with the smaller partitions set here), with partitions of 1 MB and more among them
ELEMENTS = [1000, 600_000]
ENV = {"BYTEPS_PARTITION_BYTES": str(1 << 20)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("machines,local_size,servers,ipc", [(3, 1, 2, True), (3, 1, 2, False), (1, 3, 1, True)],
                         ids=["3-machines", "3-machines-tcp", "1-machine-x3"])
def test_averages_are_bit_identical_to_dividing_the_sum(cluster, machines, local_size, servers, ipc):
    """Over TCP (no shared memory) the servers' sums of 1 MB partitions are read straight into the
    tensor and divided there."""
    c = cluster(machines, servers, local_size=local_size, env=dict(ENV, BYTEPS_ENABLE_IPC="1" if ipc else "0"))
    c.run_workers("torch_average", {"elements": ELEMENTS})
    codes, scodes, sched = c.wait_all(180)
    assert codes == [0] * 3 and sched == 0, c.all_logs()
    for r, res in c.results().items():
        v = res["value"] if "value" in res else pytest.fail(f"rank {r}: {res}\n{c.all_logs()}")
        assert v["wrong"] == [], (r, v["wrong"])
        # 5 dtypes x 2 sizes x 5 push_pull patterns, and 4 x 2 allreduces: every one in the native core
        assert v["native"] == 5 * 2 * 5 + 4 * 2, v
        assert v["native_averaged"] == 4 * 2 * 5 + 4 * 2, v  # the floats: divided in the core, not by torch
        over_tcp = not ipc and machines > 1 and set(res["link_transports"]) == {"tcp"}
        assert (res["replies_in_place"] > 0) == over_tcp, (res["replies_in_place"], res["link_transports"])


def test_divide_kernel_matches_torch_div():
    """The kernel itself (core/kernels/bps_copy.h bps_divide_copy, through _reduce.divide), every float dtype,
    divisors that round, specials (inf, nan, -0.0, subnormals) included."""
    import torch

    from byteps.core import _reduce, dtypes

    codes = {torch.float32: dtypes.FLOAT32, torch.float64: dtypes.FLOAT64, torch.float16: dtypes.FLOAT16,
             torch.bfloat16: dtypes.BFLOAT16}
    g = torch.Generator().manual_seed(5)
    base = torch.cat([torch.randn(10_000, generator=g) * 1000, torch.randn(1000, generator=g) * 1e-6,
                      torch.tensor([float("inf"), float("-inf"), -0.0, 0.0, 1e-40, 65504.0, 3.0])])
    for dtype, code in codes.items():
        for divisor in (2, 3, 7, 24):
            x = base.to(dtype)
            want = x.clone().div_(divisor)
            got = x.clone()
            _reduce.divide(got.view(torch.uint8).numpy(), divisor, code)
            assert torch.equal(got, want), (dtype, divisor, (got != want).nonzero()[:5])
    with pytest.raises(ValueError, match="int32 is not a floating dtype"):
        _reduce.divide(torch.ones(4, dtype=torch.int32).view(torch.uint8).numpy(), 3, dtypes.INT32)


def test_divide_kernel_matches_tensorflow_division():
    """byteps.tensorflow folds its float averages into the same kernel: it must divide as TensorFlow's
    ``tensor / size`` does, bit for bit, in every float dtype TensorFlow has."""
    tf = pytest.importorskip("tensorflow")
    import numpy as np

    from byteps.core import _reduce, dtypes

    codes = {tf.float32: dtypes.FLOAT32, tf.float64: dtypes.FLOAT64, tf.float16: dtypes.FLOAT16,
             tf.bfloat16: dtypes.BFLOAT16}
    rng = np.random.default_rng(7)
    base = np.concatenate([rng.standard_normal(10_000) * 1000, rng.standard_normal(1000) * 1e-6,
                           [np.inf, -np.inf, -0.0, 0.0, 1e-40, 65504.0, 3.0]])
    for dtype, code in codes.items():
        for divisor in (3, 7, 24):
            x = tf.cast(tf.constant(base), dtype)
            want = (x / tf.cast(divisor, dtype)).numpy()
            got = x.numpy().copy()
            _reduce.divide(got.reshape(-1).view(np.uint8), divisor, code)
            assert got.tobytes() == want.tobytes(), (dtype, divisor)


@pytest.mark.timeout(200)
def test_tensorflow_averages_are_bit_identical_to_dividing_the_sum(tmp_path):
    """byteps.tensorflow's averages (3 workers), eager and in a tf.function: the float ones divided in
    the native core, bit for bit as TensorFlow's ``sum / size``."""
    pytest.importorskip("tensorflow")
    from conftest import Run

    # 3 TensorFlow processes starting their first ops on 2 cores stalled every worker's heartbeats for
    # 3 s now and then (about 1 run in 6 on a 2-core VM), as
    # tests/test_tf_horovod.py saw: its heartbeat time-out here too
    run = Run(tmp_path, "tf_average", 3, 2, env={"BYTEPS_HEARTBEAT_TIMEOUT": "20"})
    for r in range(3):
        v = run.value(r)
        assert v["wrong"] == [], (r, v["wrong"])
        assert v["native_averaged"] == 4 * 2, v  # 4 float dtypes, eager and in a function
