"""byteps.tensorflow through real multi-process runs.

Importing TensorFlow costs seconds per process, so one job (2 workers, 2 servers, small
partitions) runs every check in tests/scenarios_tf.py (scenario ``tf_api``); each test below asserts
one behaviour of its results. Ground truth is computed here from the same inputs
(:func:`scenarios_tf.make_array`, integer-valued so sums are exact in every dtype), or, where it
needs TensorFlow itself, by plain TF/Keras in the worker (local gradients, single-process fit).
"""
import os
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_tf
from conftest import Run  # noqa: E402
from scenarios_tf import DTYPES, SHAPE, _fit_data, make_array  # noqa: E402

TIMEOUT = pytest.mark.timeout(300)
N = 2


@pytest.fixture(scope="module")
def tfjob(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("tf"), "tf_api", N, 2, env={"BYTEPS_PARTITION_BYTES": "256"}, timeout=240)


def total(dtype, salt=0, shape=SHAPE):
    return sum(make_array(r, dtype, shape, salt) for r in range(N))


def expect_average(dtype, s):
    return np.trunc(s / N) if dtype.startswith(("int", "uint")) else s / N  # integers: toward zero (Horovod)


@TIMEOUT
def test_basics(tfjob):
    for r in range(N):
        v = tfjob.value(r)
        assert (v["is_initialized"], v["size"], v["rank"]) == (True, N, r)


@TIMEOUT
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("op", ["Sum", "Average"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_push_pull_every_dtype(tfjob, mode, op, dtype):
    s = total(dtype)
    want = s if op == "Sum" else expect_average(dtype, s)
    for r in range(N):
        got_dtype, got_shape, got = tfjob.value(r)[f"pp.{mode}.{dtype}.{op}"]
        assert got_dtype == dtype and tuple(got_shape) == SHAPE
        np.testing.assert_array_equal(np.array(got), want, err_msg=f"rank {r} {mode} {dtype} {op}")


@TIMEOUT
@pytest.mark.parametrize("dtype", DTYPES)
def test_push_pull_named(tfjob, dtype):
    for r in range(N):
        np.testing.assert_array_equal(tfjob.value(r)[f"pp.graph_named.{dtype}"], total(dtype))
        np.testing.assert_array_equal(tfjob.value(r)[f"pp.eager_named.{dtype}"], total(dtype))


@TIMEOUT
def test_unnamed_graph_push_pulls_pair_up(tfjob):
    want = [sum(float(q + k) for q in range(N)) for k in range(12)]
    for r in range(N):
        assert tfjob.value(r)["many"] == [want] * 3


@TIMEOUT
def test_scalar_and_empty(tfjob):
    for r in range(N):
        v = tfjob.value(r)
        assert v["pp.scalar"] == sum(q + 1 for q in range(N))
        assert v["pp.scalar.graph"] == sum(q + 1 for q in range(N))
        assert v["pp.empty"] == [0, 3]


@TIMEOUT
def test_repeated_name_in_graph_loop(tfjob):
    """x <- sum(x) - x, five times in a tf.while_loop under one name."""
    xs = [make_array(r, "float64", SHAPE, 3) for r in range(N)]
    for _ in range(5):
        s = sum(xs)
        xs = [s - x for x in xs]
    for r in range(N):
        np.testing.assert_array_equal(tfjob.value(r)["repeated"], xs[r])


@TIMEOUT
def test_allreduce_ops_and_factors(tfjob):
    s = total("float32", 1)
    for r in range(N):
        v = tfjob.value(r)
        np.testing.assert_array_equal(v["ar.sum"], s)
        np.testing.assert_array_equal(v["ar.avg_default"], s / N)
        np.testing.assert_array_equal(v["ar.average_true"], s / N)
        np.testing.assert_array_equal(v["ar.average_false"], s)
        np.testing.assert_array_equal(v["ar.scaled.float32"], 3.0 * (0.5 * s) / N)
        np.testing.assert_array_equal(v["ar.scaled.graph"], 3.0 * (0.5 * s) / N)
        # integers: scaled in float64, truncated toward zero (Horovod), before the sum and after it
        pre = sum(np.trunc(make_array(q, "int32", SHAPE, 1) * 0.5) for q in range(N))
        np.testing.assert_array_equal(v["ar.scaled.int32"], np.trunc(pre * 3.0))
        assert v["ar.both_error"].startswith("ValueError") and "not both" in v["ar.both_error"]
        assert v["ar.bad_op"].startswith("NotImplementedError") and "Adasum" in v["ar.bad_op"]


@TIMEOUT
def test_fp16_compression_and_group(tfjob):
    s = total("float32", 1)
    for r in range(N):
        v = tfjob.value(r)
        assert v["fp16"][0] == "float32"
        np.testing.assert_array_equal(v["fp16"][1], s)
        np.testing.assert_array_equal(v["fp16.graph"], s)
        a, b = v["group"]
        np.testing.assert_array_equal(a, total("float32", 4))
        np.testing.assert_array_equal(b, total("int64", 4))


@TIMEOUT
def test_push_pull_gradient_is_push_pulled(tfjob):
    """d/dx sum(push_pull(2x) * c_r): the incoming gradient c_r is push_pulled with the same op."""
    cs = [np.arange(SHAPE[1], dtype=np.float64) + 10.0 * r for r in range(N)]
    want_avg = np.broadcast_to(2.0 * sum(cs) / N, SHAPE)
    want_sum = np.broadcast_to(2.0 * sum(cs), SHAPE)
    for r in range(N):
        np.testing.assert_allclose(tfjob.value(r)["pp_grad"], want_avg, rtol=1e-12)
        np.testing.assert_allclose(tfjob.value(r)["pp_grad.graph"], want_sum, rtol=1e-12)


@TIMEOUT
@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_nan_does_not_leak(tfjob, root):
    want = make_array(root, "float32", SHAPE, 6)
    for r in range(N):
        v = tfjob.value(r)
        np.testing.assert_array_equal(v[f"bc.eager.{root}"], want, err_msg=f"rank {r} eager")
        np.testing.assert_array_equal(v[f"bc.graph.{root}"], want, err_msg=f"rank {r} graph")
        np.testing.assert_array_equal(v[f"bc.int.{root}"], make_array(root, "int64", SHAPE, 7))
        assert v["bc.bad_root"].startswith("ValueError") and "root rank" in v["bc.bad_root"]


@TIMEOUT
def test_broadcast_variables(tfjob):
    want = [make_array(1, "float32", SHAPE, 8), make_array(1, "int32", SHAPE, 8),
            make_array(1, "float64", (4,), 9), make_array(1, "float64", (4,), 10) + 1]
    for r in range(N):
        v = tfjob.value(r)
        for i, (got, w) in enumerate(zip(v["bv"], want)):
            np.testing.assert_array_equal(got, w, err_msg=f"rank {r} variable {i}")
        np.testing.assert_array_equal(v["bv.graph"], make_array(0, "float32", SHAPE, 11))


@TIMEOUT
def test_broadcast_and_allgather_object(tfjob):
    for r in range(N):
        v = tfjob.value(r)
        assert v["bo"] == {"rank": 1, "payload": [0, 1, 2]}
        assert v["bo.big"] == 300000
        assert v["ago"] == [["hello", q] for q in range(N)]


@TIMEOUT
def test_unsupported_dtype_names_the_tensor(tfjob):
    for r in range(N):
        v = tfjob.value(r)
        assert v["bad.named"].startswith("TypeError") and "'bad16'" in v["bad.named"] and "int16" in v["bad.named"]
        assert v["bad.graph"].startswith("TypeError") and "'badc'" in v["bad.graph"] and "complex64" in v["bad.graph"]
        assert v["bad.unnamed"].startswith("TypeError") and "bool" in v["bad.unnamed"]
        # broadcast copies bytes: these dtypes move too (Horovod's), rank 0's values everywhere
        want = {"bool": [[1, 0, 1]], "int16": [[-5, 0, 7]], "uint16": [[65531, 0, 7]]}
        for dtype, values in want.items():
            assert v[f"bc.moved.{dtype}"] == values, (r, dtype, v[f"bc.moved.{dtype}"])
        np.testing.assert_array_equal(v["after_bad"], [sum(range(N))])  # the job carries on
    # refused on rank 1 only: rank 0's calls fail within seconds naming rank 1's reason (not after
    # BYTEPS_TIMEOUT), and the next unnamed push_pull still pairs up
    for key in ("unnamed", "allgather", "max"):
        mine, theirs = tfjob.value(1)[f"one_refused.{key}"], tfjob.value(0)[f"one_refused.{key}"]
        assert mine.startswith("TypeError") and "complex64" in mine, (key, mine)
        assert "rank 1 refused the call (TypeError" in theirs and "complex64" in theirs, (key, theirs)
    for r in range(N):
        assert tfjob.value(r)["one_refused.seconds"] < 10, tfjob.value(r)["one_refused.seconds"]
        np.testing.assert_array_equal(tfjob.value(r)["one_refused.after"], [sum(range(1, N + 1))])
    # and on a name every rank used before (the servers' rounds are abandoned): exact before and after
    mine, theirs = tfjob.value(1)["warm_refused.error"], tfjob.value(0)["warm_refused.error"]
    assert mine.startswith("TypeError") and "complex64" in mine, mine
    assert "rank 1 refused the call (TypeError" in theirs and "complex64" in theirs, theirs
    for r in range(N):
        v = tfjob.value(r)
        assert v["warm_refused.seconds"] < 10, v["warm_refused.seconds"]
        for key in ("warm_refused.warm", "warm_refused.after"):
            np.testing.assert_array_equal(v[key], [sum(range(1, N + 1))] * 3)


@TIMEOUT
def test_distributed_gradient_tape_averages(tfjob):
    locals_ = [[np.array(g) for g in tfjob.value(r)["tape.local"]] for r in range(N)]
    mean = [sum(ls[i] for ls in locals_) / N for i in range(2)]
    ssum = [sum(ls[i] for ls in locals_) for i in range(2)]
    for r in range(N):
        v = tfjob.value(r)
        assert v["tape.isinstance"] is True
        eager = v["tape.eager"]
        assert eager[2] is True, "a None gradient stays None"
        for i in range(2):
            np.testing.assert_allclose(eager[i], mean[i], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(v["tape.with"][i], mean[i], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(v["tape.graph_sum"][i], ssum[i], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(v["tape.sum"][0], mean[0], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(v["tape.local_source"][0], mean[0], rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(v["tape.local_source"][1], locals_[r][1] / N)  # register_local_source
        assert not np.allclose(locals_[0][0], locals_[1][0]), "the ranks' local gradients should differ"


@TIMEOUT
def test_distributed_optimizer_apply(tfjob):
    g1 = sum(make_array(r, "float64", (5,), 15) for r in range(N)) / N
    g2 = sum(make_array(r, "float64", (5,), 16) for r in range(N)) / N
    for r in range(N):
        v = tfjob.value(r)
        assert v["opt.class"] == ["SGD", True]
        np.testing.assert_array_equal(v["opt.eager"], -g1)
        np.testing.assert_array_equal(v["opt.graph"], -g1 - g2)
        assert v["opt.legacy"].startswith("TypeError") and "Keras 3" in v["opt.legacy"]


@TIMEOUT
def test_distributed_optimizer_backward_passes(tfjob):
    """Passes 0+1 and 2+3 are summed locally, averaged over workers, applied once each."""
    g = [sum(make_array(r, "float64", (5,), 20 + k) for r in range(N)) / N for k in range(4)]
    want = [np.zeros(5), -(g[0] + g[1]), -(g[0] + g[1]), -(g[0] + g[1] + g[2] + g[3])]
    for r in range(N):
        trace, iterations = tfjob.value(r)["opt.passes"]
        for k in range(4):
            np.testing.assert_array_equal(trace[k], want[k], err_msg=f"rank {r} after pass {k}")
        assert iterations == 2


@TIMEOUT
def test_fit_weights_identical_and_match_single_process(tfjob):
    fits = tfjob.values("fit")
    for r in range(1, N):
        assert fits[r]["weights"] == fits[0]["weights"], f"rank {r}'s weights differ from rank 0's after fit"
        assert fits[r]["weights2"] == fits[0]["weights2"], f"rank {r}'s weights differ after a second fit"
        assert fits[r]["loss"] == fits[0]["loss"], "MetricAverageCallback: the averaged losses differ"
    for got, ref in zip(fits[0]["weights"], fits[0]["ref_weights"]):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fits[0]["loss"], fits[0]["ref_loss"], rtol=1e-5)
    loss = fits[0]["loss"]
    assert loss[-1] < loss[0], f"loss did not fall: {loss}"
    x, _ = _fit_data(8, 6, N)
    assert fits[0]["iterations"] == 3 * x.shape[0] // (8 * N)


@TIMEOUT
def test_xla_is_refused_clearly(tfjob):
    for r in range(N):
        err = tfjob.value(r)["xla"]
        assert "XLA" in err and "jit_compile=False" in err, err


@TIMEOUT
def test_fit_adam_embedding_batchnorm_passes(tfjob):
    fits = tfjob.values("fit2")
    for r in range(1, N):
        assert fits[r]["weights"] == fits[0]["weights"], f"rank {r}'s trainable weights differ from rank 0's"
        assert fits[r]["opt_vars"] == fits[0]["opt_vars"], f"rank {r}'s optimizer state differs from rank 0's"
    assert all(np.isfinite(fits[0]["loss"]))
    assert fits[0]["iterations"] == 2 * (96 // 8) // 2  # one update per two backward passes


def test_async_mode_keeps_every_update(tmp_path):
    """BYTEPS_ENABLE_ASYNC with the Keras DistributedOptimizer (eager and tf.function): the servers
    start from rank 0's values and end at them plus every delta every worker pushed."""
    n, numel = 2, 700
    run = Run(tmp_path, "tf_async", n, 2, {"numel": numel, "steps": 20},
              env={"BYTEPS_ENABLE_ASYNC": "1", "BYTEPS_PARTITION_BYTES": "1024"}, timeout=240)
    want = np.arange(numel, dtype=np.float64) + sum(np.array(run.value(r)["total"]) for r in range(n))
    for r in range(n):
        np.testing.assert_array_equal(np.array(run.value(r)["final"]), want)
