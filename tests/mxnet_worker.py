"""One worker of tests/test_mxnet.py, run by .venv-mxnet's python under bpslaunch.

    bpslaunch --local --workers 2 --servers 2 -- .venv-mxnet/bin/python tests/mxnet_worker.py OUTDIR

Runs every check of byteps.mxnet and writes OUTDIR/result.<rank>.json; the test (main venv, no
mxnet) compares the ranks' results with each other and with sums it computes itself. The
single-process reference training runs here, with plain mxnet, since only this venv has mxnet.
"""
import json
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import byteps.mxnet as bps

DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8", "int8"]
SHAPES = {"small": (7,), "matrix": (64, 33), "large": (300, 1000)}  # large: many partitions


def data_for(rank, dtype, shape):
    """Integer-valued data, identical in the test's formula (tests/test_mxnet.py: expected())."""
    n = int(np.prod(shape))
    base = (np.arange(n, dtype=np.int64) * (rank + 1) + 3 * rank) % 50
    if dtype not in ("uint8",):
        base = base - 20
    return base.reshape(shape).astype(dtype)


def check_push_pull(out):
    rank = bps.rank()
    res = {}
    for dtype in DTYPES:
        for sname, shape in SHAPES.items():
            if sname == "large" and dtype not in ("float32", "int8"):
                continue
            key = f"{dtype}.{sname}"
            s = mx.nd.array(data_for(rank, dtype, shape), dtype=dtype)
            ret = bps.push_pull(s, average=False, name=f"sum.{key}")
            assert ret is s and s.dtype == np.dtype(dtype) and s.shape == shape
            a = mx.nd.array(data_for(rank, dtype, shape), dtype=dtype)
            bps.push_pull(a, average=True, name=f"avg.{key}")
            res[key] = {"sum": s.asnumpy().astype(np.float64).ravel().tolist(),
                        "avg": a.asnumpy().astype(np.float64).ravel().tolist()}
    out["push_pull"] = res

    # BytePS's name and signature, async API, unnamed calls
    b = mx.nd.array(data_for(rank, "float32", (5,)))
    bps.byteps_declare_tensor("bps.float32")
    assert bps.byteps_push_pull(b, name="bps.float32", is_average=False) is None
    c = mx.nd.array(data_for(rank, "float32", (5,)))
    handles = [bps.push_pull_async(c, average=False, name="async.float32"),
               bps.push_pull_async(mx.nd.array(data_for(rank, "int32", (5,)), dtype="int32"), average=False)]
    results = [bps.synchronize(h) for h in handles]
    assert results[0] is c
    out["byteps_push_pull"] = b.asnumpy().tolist()
    out["async"] = [r.asnumpy().astype(np.float64).tolist() for r in results]
    # the same name again: a new round of the same tensor
    d = mx.nd.array(data_for(rank, "float32", (5,)))
    bps.push_pull(d, average=False, name="bps.float32")
    out["byteps_push_pull_again"] = d.asnumpy().tolist()


def check_broadcast(out):
    rank = bps.rank()
    vals = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) * 0.5 + 0.25,
            "b": np.linspace(-1, 1, 5).astype(np.float64), "i": np.arange(4, dtype=np.int64) - 7}
    params = {k: mx.nd.array(v if rank == 0 else np.full(v.shape, np.nan if v.dtype.kind == "f" else -1),
                             dtype=v.dtype) for k, v in vals.items()}
    bps.broadcast_parameters(params, root_rank=0)
    out["broadcast_dict_exact"] = all(np.array_equal(params[k].asnumpy(), v) for k, v in vals.items())
    out["broadcast_dict_nan"] = any(np.isnan(params[k].asnumpy()).any() for k in ("w", "b"))

    # root 1, a single array
    t = mx.nd.array([10.0 * (rank + 1)] * 3) if rank == 1 else mx.nd.array([np.nan] * 3)
    ret = bps.broadcast_(t, root_rank=1, name="bcast.root1")
    out["broadcast_root1"] = ret.asnumpy().tolist()

    # gluon parameters, NaN on non-root ranks
    net = gluon.nn.Dense(3, in_units=4, prefix="bcastnet_")
    net.initialize()
    for value, p in zip((1.5, 2.5), net.collect_params().values()):  # weight, bias
        p.set_data(mx.nd.full(p.shape, value if rank == 0 else float("nan")))
    bps.broadcast_parameters(net.collect_params(), root_rank=0)
    out["broadcast_gluon"] = {k: p.data().asnumpy().ravel().tolist() for k, p in sorted(net.collect_params().items())}

    # deferred initialization is reported, naming the parameter
    lazy = gluon.nn.Dense(3, prefix="lazynet_")
    lazy.initialize()
    try:
        bps.broadcast_parameters(lazy.collect_params())
        out["broadcast_deferred_error"] = None
    except ValueError as e:
        out["broadcast_deferred_error"] = str(e)


def make_net(dtype, seed):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, in_units=6, activation="tanh", dtype=dtype),
            gluon.nn.Dense(1, in_units=16, dtype=dtype))
    net.initialize(mx.init.Normal(0.5))
    return net


def batch(rank, step, per_worker, dtype):
    rs = np.random.RandomState(1000 * step + rank)
    x = rs.randn(per_worker, 6)
    y = np.sin(x.sum(axis=1, keepdims=True))
    return mx.nd.array(x, dtype=dtype), mx.nd.array(y, dtype=dtype)


def params_of(net):
    """In creation order: the names of two nets differ (global counters), their structure does not."""
    return [p.data().asnumpy().astype(np.float64) for p in net.collect_params().values()]


def copy_params(src, dst):
    for ps, pd in zip(src.collect_params().values(), dst.collect_params().values()):
        assert ps.shape == pd.shape
        pd.set_data(ps.data().copy())


def train(net, trainer, rank, size, per_worker, steps, dtype, combined=False):
    loss_fn = gluon.loss.L2Loss()
    losses = []
    for step in range(steps):
        if combined:  # the reference: one process, every worker's batch
            parts = [batch(r, step, per_worker, dtype) for r in range(size)]
            x = mx.nd.concat(*[p[0] for p in parts], dim=0)
            y = mx.nd.concat(*[p[1] for p in parts], dim=0)
        else:
            x, y = batch(rank, step, per_worker, dtype)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        losses.append(float(loss.mean().asscalar()))
    return losses


def check_trainer(out, dtype, steps=6, per_worker=16):
    rank, size = bps.rank(), bps.size()
    net = make_net(dtype, seed=100 + rank)  # different initial values on every rank
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3})
    root_init = [p.copy() for p in params_of(net)]  # broadcast by the constructor
    ref = make_net(dtype, seed=7)
    copy_params(net, ref)
    train(net, trainer, rank, size, per_worker, steps, dtype)
    ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
                                kvstore=None)
    train(ref, ref_trainer, rank, size, per_worker, steps, dtype, combined=True)
    got, want = params_of(net), params_of(ref)
    return {"init": [p.ravel().tolist() for p in root_init], "final": [p.ravel().tolist() for p in got],
            "max_diff_vs_reference": max(float(np.abs(g - w).max()) for g, w in zip(got, want)),
            "moved": max(float(np.abs(g - i).max()) for g, i in zip(got, root_init))}


def check_optimizer(out, opt_name, opt_params, steps=5, per_worker=16):
    rank, size = bps.rank(), bps.size()
    net = make_net("float32", seed=200 + rank)
    bps.broadcast_parameters(net.collect_params(), root_rank=0, prefix=f"opt.{opt_name}.")
    init = params_of(net)
    opt = bps.DistributedOptimizer(mx.optimizer.create(opt_name, **opt_params))
    trainer = gluon.Trainer(net.collect_params(), opt, kvstore=None)
    ref = make_net("float32", seed=7)
    copy_params(net, ref)
    train(net, trainer, rank, size, per_worker, steps, "float32")
    ref_trainer = gluon.Trainer(ref.collect_params(), opt_name, dict(opt_params), kvstore=None)
    train(ref, ref_trainer, rank, size, per_worker, steps, "float32", combined=True)
    got, want = params_of(net), params_of(ref)
    return {"final": [p.ravel().tolist() for p in got],
            "max_diff_vs_reference": max(float(np.abs(g - w).max()) for g, w in zip(got, want)),
            "moved": max(float(np.abs(g - i).max()) for g, i in zip(got, init)),
            "aggregate_num": opt.aggregate_num, "learning_rate": trainer.learning_rate}


def check_two_contexts(out, steps=4, per_worker=16):
    """Two CPU contexts per worker, allreduce_grads() + update(): local sum, then across workers."""
    rank, size = bps.rank(), bps.size()
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = make_net("float64", seed=400 + rank)
    init = [p.data().copy() for p in net.collect_params().values()]
    net.initialize(force_reinit=True, ctx=ctxs)
    for p, v in zip(net.collect_params().values(), init):
        p.set_data(v)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
    ref = make_net("float64", seed=7)
    copy_params(net, ref)
    loss_fn = gluon.loss.L2Loss()
    for step in range(steps):
        x, y = batch(rank, step, per_worker, "float64")
        half = per_worker // 2
        with autograd.record():
            losses = [loss_fn(net(x[i * half:(i + 1) * half].as_in_context(c)), y[i * half:(i + 1) * half]
                              .as_in_context(c)) for i, c in enumerate(ctxs)]
        autograd.backward(losses)
        trainer.allreduce_grads()
        trainer.update(per_worker)
    ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore=None)
    train(ref, ref_trainer, rank, size, per_worker, steps, "float64", combined=True)
    per_ctx = [[p.data(c).asnumpy() for p in net.collect_params().values()] for c in ctxs]
    got, want = params_of(net), params_of(ref)
    return {"final": [p.ravel().tolist() for p in got],
            "contexts_equal": all(np.array_equal(a, b) for a, b in zip(*per_ctx)),
            "max_diff_vs_reference": max(float(np.abs(g - w).max()) for g, w in zip(got, want))}


def check_deferred_trainer(out, steps=3):
    """A deferred-initialized model: broadcast happens at the first step(); ranks end identical."""
    rank, size = bps.rank(), bps.size()
    mx.random.seed(300 + rank)
    net = gluon.nn.HybridSequential(prefix="deferred_")
    with net.name_scope():
        net.add(gluon.nn.Dense(8, activation="relu"), gluon.nn.Dense(1))
    net.initialize()
    trainer = bps.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01})
    train(net, trainer, rank, size, 8, steps, "float32")
    return [p.ravel().tolist() for p in params_of(net)]


def check_errors(out):
    errors = {}
    try:
        bps.push_pull(mx.nd.zeros((3,), dtype="bool"), name="bad_bool_tensor")
        errors["bool"] = None
    except TypeError as e:
        errors["bool"] = str(e)
    try:
        bps.push_pull(np.zeros(3, dtype=np.float32), name="numpy_not_ndarray")
        errors["numpy"] = None
    except TypeError as e:
        errors["numpy"] = str(e)
    try:
        bps.DistributedTrainer(gluon.nn.Dense(2, in_units=2).collect_params(), "sgd", compression_params={"fp16": 1})
        errors["compression"] = None
    except NotImplementedError as e:
        errors["compression"] = str(e)
    out["errors"] = errors


def check_async(out, numel=700, steps=15):
    """BYTEPS_ENABLE_ASYNC: SGD(lr=1) on gradients -delta with integer deltas; returns this rank's
    delta sum and the final values, which must be rank 0's start plus every rank's deltas."""
    r = bps.rank()
    param = mx.gluon.Parameter("w", shape=(numel,), dtype="float64")
    param.initialize(mx.init.Constant(0))
    param.set_data(mx.nd.array(np.arange(numel) * (r + 1) - 3 * r, dtype="float64"))
    trainer = bps.DistributedTrainer([param], "sgd", {"learning_rate": 1.0})
    g = np.random.default_rng(31 + r)
    total = np.zeros(numel)
    for _ in range(steps):
        delta = g.integers(-1000, 1001, numel).astype(np.float64)
        with autograd.record():  # gradient of sum(w * -delta) is -delta
            loss = (param.data() * mx.nd.array(-delta, dtype="float64")).sum()
        loss.backward()
        trainer.step(1)
        total += delta
    bps.barrier()
    with autograd.record():
        loss = (param.data() * 0).sum()
    loss.backward()
    trainer.step(1)  # a zero delta pulls the latest values
    out["async_total"] = total.tolist()
    out["async_final"] = param.data().asnumpy().tolist()


def main():
    outdir = sys.argv[1]
    if sys.argv[2:] == ["async"]:
        bps.init()
        out = {"rank": bps.rank()}
        check_async(out)
        with open(os.path.join(outdir, f"result.{bps.rank()}.json"), "w") as f:
            json.dump(out, f)
        bps.shutdown()
        return
    t0 = time.monotonic()
    bps.init()
    out = {"rank": bps.rank(), "size": bps.size(), "local_rank": bps.local_rank(), "local_size": bps.local_size(),
           "numpy": np.__version__, "mxnet": mx.__version__, "byteps_file": bps.__file__}
    check_push_pull(out)
    check_broadcast(out)
    check_errors(out)
    bps.barrier()
    out["trainer_float64"] = check_trainer(out, "float64")
    out["trainer_float32"] = check_trainer(out, "float32")
    out["optimizer_sgd"] = check_optimizer(out, "sgd", {"learning_rate": 0.1, "momentum": 0.9})
    out["optimizer_adam"] = check_optimizer(out, "adam", {"learning_rate": 0.01})
    out["trainer_deferred"] = check_deferred_trainer(out)
    out["trainer_two_contexts"] = check_two_contexts(out)
    bps.barrier()
    out["seconds"] = time.monotonic() - t0
    with open(os.path.join(outdir, f"result.{bps.rank()}.json"), "w") as f:
        json.dump(out, f)
    bps.shutdown()


if __name__ == "__main__":
    main()
