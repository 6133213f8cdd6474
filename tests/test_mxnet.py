"""byteps.mxnet, tested in its own virtual environment (.venv-mxnet: mxnet 1.9.1 + numpy 1.23.5).

This file runs in the main venv's pytest, which has no mxnet (MXNet 1.9.1 cannot import with the
main venv's numpy 2.x; docs/mxnet.md). It launches real jobs with .venv-mxnet's interpreter:
``python -m byteps.launcher --local --workers 2 --servers 2 -- python tests/mxnet_worker.py OUT``,
reads each rank's JSON results, and checks them against sums computed here. Skipped when
.venv-mxnet does not exist (``make mxnet-env`` builds it; ``make test`` does so first); refreshed
first when the byteps sources changed since it was built, so it never tests stale code.
"""
import importlib.util
import json
import os
import subprocess

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "mxnet_worker.py")
EXAMPLE = os.path.join(ROOT, "examples", "train_mxnet.py")

_spec = importlib.util.spec_from_file_location("mxnet_env", os.path.join(HERE, "mxnet_env.py"))
mxnet_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mxnet_env)
PYTHON = mxnet_env.PYTHON

pytestmark = pytest.mark.skipif(not os.access(PYTHON, os.X_OK),
                                reason=".venv-mxnet does not exist: run `make mxnet-env` (mxnet 1.9.1 needs "
                                       "numpy 1.23.5, so it cannot share the main venv; docs/mxnet.md)")

ENV = {"BYTEPS_HEARTBEAT_INTERVAL": "0.2", "BYTEPS_HEARTBEAT_TIMEOUT": "3", "BYTEPS_TIMEOUT": "60",
       "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
       "BYTEPS_PARTITION_BYTES": "65536"}

# Must match tests/mxnet_worker.py.
DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8", "int8"]
SHAPES = {"small": (7,), "matrix": (64, 33), "large": (300, 1000)}


def data_for(rank, dtype, shape):
    n = int(np.prod(shape))
    base = (np.arange(n, dtype=np.int64) * (rank + 1) + 3 * rank) % 50
    if dtype != "uint8":
        base = base - 20
    return base.reshape(shape).astype(dtype)


def expected(dtype, shape, size, average):
    total = sum(data_for(r, dtype, shape).astype(np.int64) for r in range(size))
    if average:
        total = total / size if np.dtype(dtype).kind == "f" else np.floor_divide(total, size)
    return np.asarray(total, dtype=np.float64).ravel()


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env.update(ENV)
    return env


def launch(argv, cwd, workers=2, servers=2, timeout=240, env=None):
    """Run argv under .venv-mxnet's bpslaunch; returns the CompletedProcess (output merged)."""
    cmd = [PYTHON, "-m", "byteps.launcher", "--local", "--workers", str(workers), "--servers", str(servers),
           "--timeout", str(timeout - 20), "--", PYTHON, *argv]
    return subprocess.run(cmd, cwd=cwd, env={**_clean_env(), **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fresh_env():
    """Rebuild byteps inside .venv-mxnet if its sources changed since it was installed."""
    mxnet_env.ensure()
    return PYTHON


@pytest.fixture(scope="module")
def results(fresh_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("mxnet")
    p = launch([WORKER, str(out)], cwd=out)
    assert p.returncode == 0, p.stdout[-8000:]
    res = {}
    for name in os.listdir(out):
        if name.startswith("result."):
            with open(out / name) as f:
                r = json.load(f)
            res[r["rank"]] = r
    assert sorted(res) == [0, 1], p.stdout[-8000:]
    return res


@pytest.mark.timeout(120)
def test_venv_has_the_supported_combination(fresh_env):
    code = "import numpy, mxnet, byteps; print(numpy.__version__, mxnet.__version__, byteps.__file__)"
    p = subprocess.run([PYTHON, "-c", code], cwd="/", env=_clean_env(), capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr
    np_version, mx_version, byteps_file = p.stdout.split()
    assert (np_version, mx_version) == ("1.23.5", "1.9.1")
    # a real (non-editable) install inside the venv, built against its own numpy
    assert byteps_file.startswith(os.path.dirname(os.path.dirname(PYTHON))), byteps_file


@pytest.mark.timeout(300)
def test_ranks_and_versions(results):
    for rank, r in results.items():
        assert (r["size"], r["local_rank"], r["local_size"]) == (2, 0, 1)
        assert (r["numpy"], r["mxnet"]) == ("1.23.5", "1.9.1")
        assert ".venv-mxnet" in r["byteps_file"]


@pytest.mark.timeout(300)
def test_push_pull_sum_and_average_every_dtype(results):
    checked = 0
    for r in results.values():
        for dtype in DTYPES:
            for sname, shape in SHAPES.items():
                key = f"{dtype}.{sname}"
                if key not in r["push_pull"]:
                    continue
                got = r["push_pull"][key]
                np.testing.assert_array_equal(got["sum"], expected(dtype, shape, 2, False), err_msg=key)
                np.testing.assert_array_equal(got["avg"], expected(dtype, shape, 2, True), err_msg=key)
                checked += 1
    assert checked == 2 * (len(DTYPES) * 2 + 2)


@pytest.mark.timeout(300)
def test_byteps_push_pull_async_and_repeated_names(results):
    want = expected("float32", (5,), 2, False).tolist()
    for r in results.values():
        assert r["byteps_push_pull"] == want
        assert r["byteps_push_pull_again"] == want
        assert r["async"][0] == want
        assert r["async"][1] == expected("int32", (5,), 2, False).tolist()


@pytest.mark.timeout(300)
def test_broadcast_parameters_is_a_real_broadcast(results):
    for r in results.values():
        assert r["broadcast_dict_exact"] is True
        assert r["broadcast_dict_nan"] is False
        assert r["broadcast_root1"] == [20.0] * 3
        assert r["broadcast_gluon"] == {"bcastnet_bias": [2.5] * 3, "bcastnet_weight": [1.5] * 12}
        assert "lazynet_weight" in r["broadcast_deferred_error"]
        assert "deferred" in r["broadcast_deferred_error"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which,tol", [("trainer_float64", 1e-10), ("trainer_float32", 1e-5)])
def test_distributed_trainer_matches_single_process_training(results, which, tol):
    r0, r1 = results[0][which], results[1][which]
    # ranks started from different values; the trainer broadcast rank 0's
    assert r0["init"] == r1["init"]
    # bit-identical parameters on both ranks after training
    assert r0["final"] == r1["final"]
    assert r0["moved"] > 1e-3
    for r in (r0, r1):  # equal to one process training on the combined batch
        assert r["max_diff_vs_reference"] < tol, r["max_diff_vs_reference"]


@pytest.mark.timeout(300)
def test_distributed_trainer_with_deferred_initialization(results):
    assert results[0]["trainer_deferred"] == results[1]["trainer_deferred"]


@pytest.mark.timeout(300)
def test_distributed_trainer_two_contexts_allreduce_grads_and_update(results):
    r0, r1 = results[0]["trainer_two_contexts"], results[1]["trainer_two_contexts"]
    assert r0["final"] == r1["final"]
    for r in (r0, r1):
        assert r["contexts_equal"] is True
        assert r["max_diff_vs_reference"] < 1e-10, r["max_diff_vs_reference"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["optimizer_sgd", "optimizer_adam"])
def test_distributed_optimizer_matches_single_process_training(results, which):
    r0, r1 = results[0][which], results[1][which]
    assert r0["final"] == r1["final"]
    assert r0["moved"] > 1e-3
    for r in (r0, r1):
        assert r["max_diff_vs_reference"] < 1e-5, r["max_diff_vs_reference"]
    if which == "optimizer_sgd":
        assert r0["aggregate_num"] > 0  # the aggregated (list of indices) update path ran
        assert r0["learning_rate"] == pytest.approx(0.1)


@pytest.mark.timeout(300)
def test_errors_name_the_tensor(results):
    for r in results.values():
        e = r["errors"]
        assert e["bool"] is not None and "bad_bool_tensor" in e["bool"] and "bool" in e["bool"]
        assert e["numpy"] is not None and "numpy_not_ndarray" in e["numpy"] and "NDArray" in e["numpy"]
        assert e["compression"] is not None and "compression" in e["compression"]


@pytest.mark.timeout(300)
def test_example_trains_and_ends_identical(fresh_env, tmp_path):
    p = launch([EXAMPLE, "--epochs", "3"], cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-8000:]
    assert "final parameters identical on all 2 workers: True" in p.stdout, p.stdout[-4000:]
    assert p.stdout.count("] epoch ") == 3, p.stdout[-4000:]  # rank 0 prints one line per epoch


SINGLE = """
import mxnet as mx, numpy as np
from mxnet import autograd, gluon
import byteps.mxnet as bps
bps.init()
assert (bps.rank(), bps.size(), bps.local_rank(), bps.local_size()) == (0, 1, 0, 1)
t = mx.nd.array([1, 2, 3], dtype='int32')
assert bps.push_pull(t, average=True, name='t') is t and t.asnumpy().tolist() == [1, 2, 3]
bps.byteps_push_pull(t, name='t')
bps.broadcast_parameters({'t': t}, root_rank=0)
for make in (lambda p: bps.DistributedTrainer(p, 'sgd', {'learning_rate': 0.1}),
             lambda p: gluon.Trainer(p, bps.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1)), kvstore=None)):
    net = gluon.nn.Dense(1, in_units=3)
    net.initialize()
    w0 = net.weight.data().asnumpy().copy()
    trainer = make(net.collect_params())
    x = mx.nd.ones((4, 3))
    with autograd.record():
        loss = (net(x) - 1) ** 2
    loss.backward()
    trainer.step(4)
    assert not np.array_equal(w0, net.weight.data().asnumpy())
bps.barrier()
bps.shutdown()
print('single ok')
"""


@pytest.mark.timeout(120)
def test_single_process_without_launcher(fresh_env, tmp_path):
    """N=1: no scheduler, no servers; every call is the identity and training still steps."""
    p = subprocess.run([PYTHON, "-c", SINGLE], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
                       timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "single ok" in p.stdout


def test_async_trainer_keeps_every_update(fresh_env, tmp_path):
    """BYTEPS_ENABLE_ASYNC with DistributedTrainer: start from rank 0's values, end at them plus
    every delta of every worker (exact: integer deltas in float64)."""
    p = launch([WORKER, str(tmp_path), "async"], cwd=tmp_path, env={"BYTEPS_ENABLE_ASYNC": "1",
                                                                   "BYTEPS_PARTITION_BYTES": "1024"})
    assert p.returncode == 0, p.stdout[-8000:]
    res = {}
    for r in (0, 1):
        with open(tmp_path / f"result.{r}.json") as f:
            res[r] = json.load(f)
    want = np.arange(700, dtype=np.float64) + sum(np.array(res[r]["async_total"]) for r in (0, 1))
    for r in (0, 1):
        np.testing.assert_array_equal(np.array(res[r]["async_final"]), want)
