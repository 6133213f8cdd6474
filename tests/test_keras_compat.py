"""``byteps.tensorflow.keras`` and ``byteps.keras`` (Horovod's and BytePS's Keras modules) on a real
2-worker job (tests/scenarios_keras.py); expected values are computed here or, for Keras training,
by a single-process Keras run in the worker."""
import os
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_keras
from conftest import Run  # noqa: E402
from scenarios_keras import BASE_LR, EPOCHS, HALVE_FROM, STEPS, WARMUP_EPOCHS  # noqa: E402

N = 2
TIMEOUT = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("keras"), "keras_api", N, 1, timeout=240)


@TIMEOUT
def test_same_api_under_both_module_paths(job):
    assert all(job.values("same_api"))


@TIMEOUT
def test_value_collectives(job):
    base = np.arange(10.0).reshape(5, 2)
    total = sum(base * (r + 1) for r in range(N))
    for r, v in enumerate(job.values()):
        assert v["allreduce"] == (total / N).tolist()
        assert v["allreduce_sum"] == total.tolist() and v["push_pull"] == total.tolist()
        assert v["broadcast"] == (base * N).tolist()
        assert v["allgather"] == [[float(q)] * 2 for q in range(N) for _ in range(q + 1)]
        start = [0, 3][r]  # 5 rows over 2 ranks: 3 and 2
        assert v["reducescatter"] == total[start:start + [3, 2][r]].tolist()
        assert v["broadcast_global_variables"].startswith("RuntimeError") and \
            "BroadcastGlobalVariablesCallback" in v["broadcast_global_variables"]


@TIMEOUT
def test_predivide_factor_and_averaged_passes(job):
    # sum of 2 passes (x1, x2), halved (average_aggregated_gradients), averaged over ranks (x1, x2): 2.25
    for v in job.values():
        assert v["passes"] == [-2.25, -4.5, -6.75]


def expected_rates(n):
    """Horovod's warm-up (per batch, linear from lr/size to lr over WARMUP_EPOCHS), then the rate
    left there, then halved from HALVE_FROM (staircase)."""
    rates, lr = [], BASE_LR
    for epoch in range(EPOCHS):
        for batch in range(STEPS):
            if epoch < WARMUP_EPOCHS:
                e = epoch + batch / STEPS + 1 / STEPS
                lr = BASE_LR * (e * (n - 1) / WARMUP_EPOCHS + 1) / n
            if epoch >= HALVE_FROM and batch == 0:
                lr = BASE_LR * 0.5
            rates.append(lr)
    return rates


@TIMEOUT
def test_fit_with_every_callback_matches_single_process(job):
    fits = job.values("fit")
    for r in range(1, N):
        assert fits[r]["weights"] == fits[0]["weights"], f"rank {r}'s weights differ from rank 0's after fit"
        assert fits[r]["loss"] == fits[0]["loss"], "MetricAverageCallback: the averaged losses differ"
    want = expected_rates(N)
    for f in fits:
        np.testing.assert_allclose(f["lrs"], want, rtol=1e-12)
        np.testing.assert_allclose(f["lr_log"], [want[(e + 1) * STEPS - 1] for e in range(EPOCHS)], rtol=1e-12)
    assert want[0] < BASE_LR / N * 1.2 and want[-1] == BASE_LR / 2
    # float64 model: the averaged gradients equal the combined batch's up to rounding
    for got, ref in zip(fits[0]["weights"], fits[0]["ref_weights"]):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(fits[0]["loss"], fits[0]["ref_loss"], rtol=1e-10)
    assert fits[0]["loss"][-1] < fits[0]["loss"][0]


@TIMEOUT
def test_load_model_wraps_the_restored_optimizer(job):
    vals = job.values("loaded")
    for v in vals:
        assert v["class"] == "SGD" and v["distributed"] and v["same_weights"]
        assert v["iterations"] == EPOCHS * STEPS
    assert all(v["weights"] == vals[0]["weights"] for v in vals)
    assert vals[0]["weights"] != job.value(0, "fit")["weights"]


def test_schedule_callback_takes_horovod_and_byteps_argument_orders():
    from byteps.tensorflow.keras.callbacks import LearningRateScheduleCallback as S

    def f(epoch):
        return 0.1 * epoch

    horovod = S(0.2, f, 3)                        # (initial_lr, multiplier, start_epoch)
    assert (horovod.initial_lr, horovod.multiplier, horovod.start_epoch) == (0.2, f, 3)
    byteps = S(f, 3, 7)                           # (multiplier, start_epoch, end_epoch)
    assert (byteps.initial_lr, byteps.multiplier, byteps.start_epoch, byteps.end_epoch) == (None, f, 3, 7)
    lone = S(0.5, start_epoch=2, initial_lr=0.1)  # BytePS: a lone multiplier, initial_lr by keyword
    assert (lone.initial_lr, lone.multiplier(9), lone.start_epoch, lone.staircase) == (0.1, 0.5, 2, True)
    keywords = S(initial_lr=0.3, multiplier=f, staircase=False)
    assert (keywords.initial_lr, keywords.multiplier, keywords.staircase) == (0.3, f, False)
    with pytest.raises(ValueError, match="multiplier"):
        S(initial_lr=0.3)


@pytest.mark.timeout(300)
def test_mirrored_strategy_fit_matches_single_process(tmp_path):
    """byteps.tensorflow.distribute.MirroredStrategy: reductions reach every worker."""
    vals = Run(tmp_path, "tf_mirrored", N, 1, timeout=240).values()
    for r in range(1, N):
        assert vals[r]["weights"] == vals[0]["weights"], f"rank {r}'s weights differ from rank 0's"
    assert vals[0]["replicas"] == 1
    for got, ref in zip(vals[0]["weights"], vals[0]["ref_weights"]):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    # the logged loss is each worker's own (Keras' metrics), like any fit without MetricAverageCallback
    np.testing.assert_allclose(np.mean([v["loss"] for v in vals], axis=0), vals[0]["ref_loss"], rtol=1e-10)


@TIMEOUT
def test_broadcast_callback_with_a_lazily_built_model(tmp_path):
    """Workers start from different weights of a model Keras builds at the first batch: fit runs, and the
    broadcast at the end of that batch leaves every worker with the same weights and optimizer state."""
    run = Run(tmp_path, "keras_lazy_model", N, 1, timeout=240)
    vals = run.values()
    assert all(v["optimizer_variables"] > 0 for v in vals)
    for w0, w1 in zip(vals[0]["weights"], vals[1]["weights"]):
        assert np.array_equal(np.asarray(w0), np.asarray(w1)), "the workers' weights differ after fit"
