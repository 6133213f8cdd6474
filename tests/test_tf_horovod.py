"""byteps.tensorflow's Horovod extras on 2 real workers: SyncBatchNormalization against Keras's batch
normalization of the concatenated batches, and the elastic state (tests/scenarios_tf_horovod.py)."""
import os
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios
from conftest import Run  # noqa: E402

N = 2
TIMEOUT = pytest.mark.timeout(300)
# TensorFlow's import and first traces hold a loaded machine's cores for seconds: heartbeats get room
ENV = {"BYTEPS_HEARTBEAT_TIMEOUT": "20"}


@TIMEOUT
def test_sync_batch_norm_equals_batch_norm_of_all_batches(tmp_path):
    run = Run(tmp_path, "tf_sync_batch_norm", N, 1, env=ENV, timeout=240)
    values = run.values()
    want = values[0]["want"]
    for r, v in enumerate(values):
        assert v["same_class"] and "fused=True" in v["fused_error"]
        rows = slice(v["first"], v["first"] + v["rows"])
        for mode in ("eager", "function"):
            got = v[mode]
            for key in ("y", "dx", "inference"):
                np.testing.assert_allclose(got[key], np.array(want[key])[rows], rtol=1e-9, atol=1e-9,
                                           err_msg=f"rank {r} {mode} {key}")
            for key in ("moving_mean", "moving_variance"):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-12, err_msg=f"rank {r} {mode} {key}")
    for mode in ("eager", "function"):  # each rank's gamma/beta gradient is its share of the whole batch's
        for key in ("dgamma", "dbeta"):
            np.testing.assert_allclose(sum(np.array(v[mode][key]) for v in values), want[key], rtol=1e-9,
                                       err_msg=f"{mode} {key}")


@TIMEOUT
def test_elastic_state_sync_restore_commit(tmp_path):
    run = Run(tmp_path, "tf_elastic_state", N, 1, env=ENV, timeout=240)
    values = run.values()
    rank0 = [np.full((2, 2), 1.0).tolist(), np.arange(3.0).tolist()]
    keras_start = values[0]["keras"][0]
    for r, v in enumerate(values):
        assert v["synced"] == [rank0, 20, 10], f"rank {r}"
        assert v["restored"] == [rank0, 20], f"rank {r}"
        assert v["committed"] == [[np.full((2, 2), 5.0 + r).tolist(), np.full(3, 5.0 + r).tolist()], 21], f"rank {r}"
        start, trained, restored, epoch = v["keras"]
        assert start == keras_start, f"rank {r}: run() did not start from rank 0's model"
        assert trained != start and restored == start and epoch == 0, f"rank {r}"
        cb = v["callbacks"]  # batch indices 0, 1, 2 of epoch 0, a commit after index 1
        assert cb["after_fit"] == [0, 0] and cb["restored"] == [1, 0], f"rank {r}: {cb}"
        assert cb["weights_are_batch_1"] and not cb["weights_are_batch_2"], f"rank {r}: {cb}"


@TIMEOUT
def test_one_rank_refusing_an_alltoall_fails_it_on_every_rank_promptly(tmp_path):
    # BYTEPS_TIMEOUT is long, so an error that waited for it could not pass for a prompt one
    run = Run(tmp_path, "tf_one_rank_refuses", N, 1, env={**ENV, "BYTEPS_TIMEOUT": "120"}, timeout=240)
    values = run.values()
    for r, v in enumerate(values):
        for mode in ("eager", "function"):
            error, seconds = v[mode]
            assert "InvalidArgumentError" in error and "rank 1's splits ([3, -1])" in error, f"rank {r} {mode}: {error}"
            assert "rank 0" not in error and "tf.alltoall" in error, f"rank {r} {mode}: {error}"
            assert seconds < 10, f"rank {r} {mode}: the error took {seconds:.1f} s"
        x = [np.arange(2 * N) + 100 * q for q in range(N)]
        assert v["after"][0] == np.concatenate([x[q][2 * r:2 * r + 2] for q in range(N)]).tolist(), f"rank {r}"
        assert v["after"][1] == sum(x).tolist(), f"rank {r}"
