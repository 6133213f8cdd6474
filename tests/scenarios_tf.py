"""byteps.tensorflow scenarios for tests/test_tensorflow.py.

One scenario (``tf_api``) runs every check in one job, because importing TensorFlow costs seconds
per process. It returns raw values (lists, error texts); the test rebuilds each rank's inputs
with :func:`make_array` and computes the ground truth itself. Where the truth needs TensorFlow
(local gradients, single-process Keras training) the worker computes it with plain TF/Keras,
without byteps, and returns it beside the distributed result.

TensorFlow is imported inside the scenario, so the torch scenarios never pay for it.
"""
import sys
import time

import numpy as np


def scenario(fn):
    """Register ``fn`` with the runner (tests/scenarios.py, which imports this file), if it is running.

    The test process imports this file for its generators only, without importing the runner
    (and so torch).
    """
    runner = sys.modules.get("scenarios")
    return runner.scenario(fn) if runner is not None else fn


DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"]
SHAPE = (3, 50)


def make_array(rank, dtype, shape=SHAPE, salt=0):
    """Rank ``rank``'s integer-valued data (exact in every dtype, and so are sums and halves)."""
    g = np.random.default_rng(100003 * rank + 7919 * salt + 1)
    lo = 0 if dtype == "uint8" else -8
    return g.integers(lo, 9, size=shape).astype(np.float64)


def _tf():
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(2)
    return tf


def _err(fn):
    try:
        fn()
        return "no error"
    except Exception as e:  # the test reads the text
        return f"{type(e).__name__}: {e}"


def _as_list(t):
    import tensorflow as tf

    return np.asarray(tf.cast(t, tf.float64)).tolist()


@scenario
def tf_api(out, args):
    tf = _tf()
    import keras

    import byteps.tensorflow as bps

    r, n = bps.rank(), bps.size()
    res = {"is_initialized": bps.is_initialized(), "size": bps.size(), "rank": bps.rank()}

    def tensor(dtype, salt=0, shape=SHAPE):
        return tf.cast(tf.constant(make_array(r, dtype, shape, salt)), getattr(tf, dtype))

    # ---------------------------------------------------------------- push_pull, every dtype, eager + graph
    @tf.function
    def graph_pp(x, op):
        return bps.push_pull(x, op=op)

    @tf.function
    def graph_pp_named(x, name):
        return bps.push_pull(x, name=name, op=bps.Sum)

    for dtype in DTYPES:
        x = tensor(dtype)
        for op in ("Sum", "Average"):
            y = bps.push_pull(x, op=op)
            res[f"pp.eager.{dtype}.{op}"] = [y.dtype.name, list(y.shape), _as_list(y)]
            y = graph_pp(x, op)
            res[f"pp.graph.{dtype}.{op}"] = [y.dtype.name, list(y.shape), _as_list(y)]
        y = graph_pp_named(x, f"named.{dtype}")
        res[f"pp.graph_named.{dtype}"] = _as_list(y)
        y = bps.push_pull(x, average=False, name=f"eager_named.{dtype}")
        res[f"pp.eager_named.{dtype}"] = _as_list(y)

    # many independent unnamed push_pulls in one tf.function: they must start in program order on
    # every worker (automatic control dependencies), or the automatic names would pair up wrongly
    @tf.function
    def many(xs):
        return [bps.push_pull(x, op=bps.Sum) for x in xs]

    xs = [tf.fill((k + 1, 7 - k % 3), float(r + k)) for k in range(12)]
    res["many"] = [[_as_list(t)[0][0] for t in many(xs)] for _ in range(3)]

    # scalars and empty tensors
    res["pp.scalar"] = _as_list(bps.push_pull(tf.constant(float(r + 1)), op=bps.Sum))
    res["pp.scalar.graph"] = _as_list(tf.function(lambda t: bps.push_pull(t, op=bps.Sum))(tf.constant(r + 1)))
    e = bps.push_pull(tf.zeros((0, 3)), op=bps.Sum)
    res["pp.empty"] = list(e.shape)

    # the same named tensor again and again (one key, many rounds), in a tf.function loop
    @tf.function
    def repeated(x):
        for _ in tf.range(5):
            x = bps.push_pull(x, name="repeated", op=bps.Sum) - x
        return x

    res["repeated"] = _as_list(repeated(tensor("float64", salt=3)))

    # ---------------------------------------------------------------- allreduce: op, average=, factors, fp16
    x32, xi = tensor("float32", 1), tensor("int32", 1)
    res["ar.sum"] = _as_list(bps.allreduce(x32, op=bps.Sum))
    res["ar.avg_default"] = _as_list(bps.allreduce(x32))
    res["ar.average_true"] = _as_list(bps.allreduce(x32, average=True))
    res["ar.average_false"] = _as_list(bps.allreduce(x32, average=False))
    res["ar.scaled.float32"] = _as_list(bps.allreduce(x32, op=bps.Average, prescale_factor=0.5, postscale_factor=3.0))
    res["ar.scaled.int32"] = _as_list(bps.allreduce(xi, op=bps.Sum, prescale_factor=0.5, postscale_factor=3.0))
    res["ar.scaled.graph"] = _as_list(tf.function(
        lambda t: bps.allreduce(t, op=bps.Average, prescale_factor=0.5, postscale_factor=3.0))(x32))
    res["ar.both_error"] = _err(lambda: bps.allreduce(x32, average=True, op=bps.Sum))
    res["ar.bad_op"] = _err(lambda: bps.allreduce(x32, op="Adasum"))
    y = bps.push_pull(x32, op=bps.Sum, compression=bps.Compression.fp16)
    res["fp16"] = [y.dtype.name, _as_list(y)]
    res["fp16.graph"] = _as_list(tf.function(
        lambda t: bps.push_pull(t, op=bps.Sum, compression=bps.Compression.fp16))(x32))
    g = bps.push_pull_group([tensor("float32", 4), tensor("int64", 4)], names=["grp.a", "grp.b"], op=bps.Sum)
    res["group"] = [_as_list(t) for t in g]

    # ---------------------------------------------------------------- gradient of push_pull
    xg = tf.Variable(tensor("float64", 5))
    c = tf.constant(np.arange(SHAPE[1], dtype=np.float64) + 10.0 * r)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(bps.push_pull(xg * 2.0, op=bps.Average) * c)
    res["pp_grad"] = _as_list(tape.gradient(loss, xg))

    @tf.function
    def graph_grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(bps.allreduce(xg * 2.0, op=bps.Sum, name="gg") * c)
        return tape.gradient(loss, xg)

    res["pp_grad.graph"] = _as_list(graph_grad())

    # ---------------------------------------------------------------- broadcast
    for root in (0, 1):
        poison = np.full(SHAPE, np.nan) if r != root else make_array(root, "float32", SHAPE, 6)
        poison[0, 0] = np.inf if r != root else poison[0, 0]
        p = tf.constant(poison, dtype=tf.float32)
        res[f"bc.eager.{root}"] = _as_list(bps.broadcast(p, root))
        res[f"bc.graph.{root}"] = _as_list(tf.function(lambda t, root=root: bps.broadcast(t, root, name="bcg"))(p))
        res[f"bc.int.{root}"] = _as_list(bps.broadcast(tensor("int64", 7), root_rank=root))
    res["bc.bad_root"] = _err(lambda: bps.broadcast(x32, root_rank=n))

    # ---------------------------------------------------------------- broadcast_variables, broadcast_object
    tv = [tf.Variable(tensor("float32", 8)), tf.Variable(tensor("int32", 8)),
          keras.Variable(make_array(r, "float64", (4,), 9), dtype="float64", name="kernel"),
          keras.Variable(make_array(r, "float64", (4,), 10) + 1, dtype="float64", name="kernel")]
    bps.broadcast_variables(tv, root_rank=1)
    res["bv"] = [_as_list(tf.convert_to_tensor(v)) for v in tv]
    gv = tf.Variable(tensor("float32", 11))
    tf.function(lambda: bps.broadcast_variables([gv], root_rank=0))()
    res["bv.graph"] = _as_list(gv)
    res["bo"] = bps.broadcast_object({"rank": r, "payload": list(range(r * 3))}, root_rank=1)
    res["bo.big"] = len(bps.broadcast_object(b"x" * (300000 + r), root_rank=0))
    res["ago"] = bps.allgather_object(("hello", r))

    # ---------------------------------------------------------------- unsupported dtypes
    res["bad.named"] = _err(lambda: bps.push_pull(tf.constant([1, 2], dtype=tf.int16), name="bad16"))
    res["bad.graph"] = _err(lambda: tf.function(lambda t: bps.push_pull(t, name="badc"))(
        tf.constant([1 + 2j], dtype=tf.complex64)))
    res["bad.unnamed"] = _err(lambda: bps.push_pull(tf.constant([True])))
    for dtype, root_value in (("bool", [[1, 0, 1]]), ("int16", [[-5, 0, 7]]), ("uint16", [[65531, 0, 7]])):
        mine = root_value if r == 0 else [[0, 1, 0]]
        value = tf.cast(tf.constant(mine, dtype=tf.int64), getattr(tf, dtype))
        res[f"bc.moved.{dtype}"] = _as_list(tf.cast(bps.broadcast(value, 0, name=f"bc.moved.{dtype}"), tf.int64))
    res["after_bad"] = _as_list(bps.push_pull(tf.constant([float(r)]), op=bps.Sum, name="after_bad"))
    # refused on rank 1 only (BYTEPS_TIMEOUT is 30 s): rank 0 fails at once, naming rank 1, and the
    # automatic names stay in step (the unnamed push_pull after them pairs up)
    began = time.monotonic()
    mine = tf.constant([1.0]) if r == 0 else tf.constant([1j], dtype=tf.complex64)
    res["one_refused.unnamed"] = _err(lambda: bps.push_pull(mine))
    res["one_refused.allgather"] = _err(lambda: bps.allgather(mine, name="ag.refused"))
    res["one_refused.max"] = _err(lambda: bps.allreduce(mine, op=bps.Max))
    res["one_refused.seconds"] = time.monotonic() - began
    res["one_refused.after"] = _as_list(bps.push_pull(tf.constant([float(r + 1)]), op=bps.Sum))
    # the same on a name every rank used before: its key is cached, nobody declares it again, so rank 1
    # abandons the servers' rounds of the call (core/wire.py FLAG_ABANDON)
    def warm_call(t):
        return _as_list(bps.push_pull(t, op=bps.Sum, name="warm.refused"))

    res["warm_refused.warm"] = warm_call(tf.constant([float(r + 1)] * 3))
    began = time.monotonic()
    refused = tf.constant([1j] * 3, dtype=tf.complex64) if r == 1 else tf.constant([1.0] * 3)
    res["warm_refused.error"] = _err(lambda: warm_call(refused))
    res["warm_refused.seconds"] = time.monotonic() - began
    res["warm_refused.after"] = warm_call(tf.constant([float(r + 1)] * 3))

    # ---------------------------------------------------------------- DistributedGradientTape
    w1 = tf.Variable(make_array(0, "float64", (6, 5), 12) / 8)
    w2 = tf.Variable(make_array(0, "float64", (5,), 13) / 8)
    xb = tf.constant(make_array(r, "float64", (16, 6), 14) / 8)
    unused = tf.Variable([1.0], dtype=tf.float64)

    def loss_fn():
        return tf.reduce_mean(tf.tanh(xb @ w1) @ w2[:, None] ** 2)

    with tf.GradientTape() as plain:
        lv = loss_fn()
    res["tape.local"] = [_as_list(g) for g in plain.gradient(lv, [w1, w2])]
    with tf.GradientTape() as t0:
        lv = loss_fn()
    dt = bps.DistributedGradientTape(t0)
    res["tape.isinstance"] = isinstance(dt, tf.GradientTape)
    grads = dt.gradient(lv, [w1, w2, unused])
    res["tape.eager"] = [_as_list(g) for g in grads[:2]] + [grads[2] is None]
    with bps.DistributedGradientTape(tf.GradientTape(persistent=True)) as t1:
        lv = loss_fn()
    res["tape.with"] = [_as_list(g) for g in t1.gradient(lv, {"a": w1, "b": w2}).values()]
    res["tape.sum"] = [_as_list(g) for g in t1.gradient(lv, [w1])]  # persistent: a second gradient() works
    del t1

    @tf.function
    def graph_tape():
        with tf.GradientTape() as t:
            lv = loss_fn()
        return bps.DistributedGradientTape(t, op=bps.Sum).gradient(lv, [w1, w2])

    res["tape.graph_sum"] = [_as_list(g) for g in graph_tape()]
    with tf.GradientTape() as t2:  # Horovod's model parallelism: w2's gradient stays local, divided by size
        lv = loss_fn()
    dt = bps.DistributedGradientTape(t2)
    dt.register_local_source(w2)
    res["tape.local_source"] = [_as_list(g) for g in dt.gradient(lv, [w1, w2])]

    # ---------------------------------------------------------------- DistributedOptimizer: apply_gradients
    v = keras.Variable(np.zeros(5), dtype="float64")
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0))
    res["opt.class"] = [type(opt).__name__, isinstance(opt, keras.optimizers.SGD)]
    opt.apply_gradients([(tf.constant(make_array(r, "float64", (5,), 15)), v)])
    res["opt.eager"] = _as_list(tf.convert_to_tensor(v))
    tf.function(lambda: opt.apply([tf.constant(make_array(r, "float64", (5,), 16))], [v]))()
    res["opt.graph"] = _as_list(tf.convert_to_tensor(v))
    res["opt.legacy"] = _err(lambda: bps.DistributedOptimizer(object()))

    # backward_passes_per_step=2: two local passes summed, then one averaged update
    v2 = keras.Variable(np.zeros(5), dtype="float64")
    opt2 = bps.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0), backward_passes_per_step=2,
                                    name="bpps")
    step = tf.function(lambda g: opt2.apply([g], [v2]))
    trace = []
    for k in range(4):
        step(tf.constant(make_array(r, "float64", (5,), 20 + k)))
        trace.append(_as_list(tf.convert_to_tensor(v2)))
    res["opt.passes"] = [trace, int(opt2.iterations.numpy())]

    res["fit"] = _fit(tf, keras, bps, r, n, args)
    res["fit2"] = _fit_more(keras, bps, r)
    res["xla"] = _err(lambda: tf.function(lambda t: bps.push_pull(t, name="xla"), jit_compile=True)(x32))
    return res


def _make_model(keras, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def _fit_data(per_worker, steps, n):
    g = np.random.default_rng(77)
    x = g.normal(size=(per_worker * n * steps, 6)).astype(np.float32)
    y = np.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], 1).astype(np.float32)
    return x, y


def _fit(tf, keras, bps, r, n, args):
    """model.fit with DistributedOptimizer + both callbacks; rank 0 also trains the single-process reference."""
    per_worker, steps, epochs = 8, 6, 3
    x, y = _fit_data(per_worker, steps, n)
    # worker r's batch s is rows [s*n*B + r*B, ... + B) of the combined data: together, combined batch s
    idx = np.concatenate([np.arange(s * n * per_worker + r * per_worker, s * n * per_worker + (r + 1) * per_worker)
                          for s in range(steps)])
    model = _make_model(keras, seed=1000 + r)  # different initial weights on each rank: the callback fixes them
    init_weights = [w.copy() for w in model.get_weights()]
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    hist = model.fit(x[idx], y[idx], batch_size=per_worker, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0),
                                bps.callbacks.MetricAverageCallback()])
    out = {"weights": [w.astype(np.float64).tolist() for w in model.get_weights()],
           "loss": [float(v) for v in hist.history["loss"]],
           "iterations": int(model.optimizer.iterations.numpy())}
    if r == 0:  # the reference: the same model from rank 0's initial weights, one process, combined batches
        ref = _make_model(keras, seed=1000)
        ref.set_weights(init_weights)
        ref.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), loss="mse", jit_compile=False)
        rh = ref.fit(x, y, batch_size=per_worker * n, epochs=epochs, shuffle=False, verbose=0)
        out["ref_weights"] = [w.astype(np.float64).tolist() for w in ref.get_weights()]
        out["ref_loss"] = [float(v) for v in rh.history["loss"]]
    # a second fit must not broadcast again nor hang; weights stay identical
    model.fit(x[idx], y[idx], batch_size=per_worker, epochs=1, shuffle=False, verbose=0,
              callbacks=[bps.callbacks.MetricAverageCallback()])
    out["weights2"] = [w.astype(np.float64).tolist() for w in model.get_weights()]
    return out


def _fit_more(keras, bps, r):
    """Adam, an Embedding (sparse gradients), BatchNormalization (non-trainable state), Dropout,
    fp16 compression, steps_per_execution=3 and backward_passes_per_step=2: weights stay identical."""
    keras.utils.set_random_seed(50 + r)
    inp = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(20, 5)(inp)
    h = keras.layers.Flatten()(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.2)(h)
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    opt = bps.DistributedOptimizer(keras.optimizers.Adam(0.01), compression=bps.Compression.fp16,
                                   backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse", steps_per_execution=3, jit_compile=False)
    g = np.random.default_rng(9 + r)
    x = g.integers(0, 20, size=(96, 4)).astype(np.int32)
    y = (x.sum(1, keepdims=True) / 40.0).astype(np.float32)
    hist = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                     callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0),
                                bps.callbacks.MetricAverageCallback()])
    # BatchNormalization's moving statistics are local (computed from each worker's own batches)
    return {"weights": [np.asarray(w).astype(np.float64).tolist() for w in model.trainable_weights],
            "opt_vars": [np.asarray(v).astype(np.float64).tolist() for v in model.optimizer.variables],
            "loss": [float(v) for v in hist.history["loss"]],
            "iterations": int(model.optimizer.iterations.numpy())}


@scenario
def tf_async(out, args):
    """BYTEPS_ENABLE_ASYNC: integer deltas applied by SGD(lr=1) with gradients -delta, eagerly and
    inside tf.function; returns the sum of this rank's deltas and the final values."""
    tf = _tf()
    import keras

    import byteps.tensorflow as bps

    r, numel = bps.rank(), args["numel"]
    var = tf.Variable(np.arange(numel, dtype=np.float64) * (r + 1) - 3 * r)
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0))
    total = np.zeros(numel)
    g = np.random.default_rng(31 + r)

    @tf.function
    def traced(grad):
        opt.apply_gradients([(grad, var)])

    for step in range(args["steps"]):
        delta = g.integers(-1000, 1001, numel).astype(np.float64)
        apply = traced if step % 2 else (lambda grad: opt.apply_gradients([(grad, var)]))
        apply(tf.constant(-delta))
        total += delta
    bps.barrier()
    opt.apply_gradients([(tf.zeros(numel, dtype=tf.float64), var)])  # a zero delta pulls the latest
    return {"total": total.tolist(), "final": var.numpy().tolist()}


@scenario
def tf_average(out, args):
    """Averaged push_pulls (the default) of every float dtype and int32, eager and in a tf.function,
    against the sum divided by TensorFlow itself (``sum / size``; floor division for integers)."""
    import tensorflow as tf

    import byteps.tensorflow as bps
    from byteps import common

    bps.init()
    rank, size = bps.rank(), bps.size()
    averaged0 = common.metrics()["native"]["averaged"]
    wrong = []
    for dtype in ("float32", "float64", "float16", "bfloat16", "int32"):
        tf_dtype = getattr(tf, dtype)

        def data(r):  # small integers: every sum exact, the division by size rounds
            return tf.cast((tf.range(600, dtype=tf.int64) * 7 + r * 5) % 80, tf_dtype)

        total = tf.cast(sum(tf.cast(data(r), tf.float64) for r in range(size)), tf_dtype)
        want = (total / tf.cast(size, tf_dtype) if tf_dtype.is_floating else total // size).numpy()
        got = {"eager": bps.push_pull(data(rank), name=f"avg.eager.{dtype}"),
               "function": tf.function(lambda x: bps.push_pull(x, name=f"avg.fn.{dtype}"))(data(rank))}
        for how, value in got.items():
            if value.numpy().tobytes() != want.tobytes():
                wrong.append(f"{how} {dtype}: got {value.numpy()[:4]}, want {want[:4]}")
    return {"wrong": wrong, "native_averaged": common.metrics()["native"]["averaged"] - averaged0}
