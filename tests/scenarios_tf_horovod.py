"""Scenarios for tests/test_tf_horovod.py: byteps.tensorflow's SyncBatchNormalization and elastic state.

Each worker computes its reference with plain Keras on data it rebuilds for every rank (the batch of all
ranks concatenated), so the test compares distributed results with a local computation.
"""
import numpy as np

from scenarios_tf import _tf, scenario

CHANNELS = 3


def batch(rank):
    """Rank ``rank``'s batch: 2 + rank rows (the ranks' batches differ in size), 4 x CHANNELS each."""
    g = np.random.default_rng(11 + rank)
    return g.normal(size=(2 + rank, 4, CHANNELS)) * (rank + 1) + rank


def _bn_results(tf, layer, x, upstream, traced):
    """Two training calls of ``layer`` on ``x`` (the moving statistics move twice), eagerly or in one
    tf.function: the second call's output, the gradients of sum(output * upstream) by x, gamma and beta,
    the moving statistics, and the inference output."""
    layer.build(x.shape)

    def step(x, upstream):
        layer(x, training=True)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * upstream)
        return [y, *tape.gradient(loss, [x, layer.gamma, layer.beta])]

    y, dx, dgamma, dbeta = (tf.function(step) if traced else step)(x, upstream)
    return {"y": y.numpy(), "dx": dx.numpy(), "dgamma": dgamma.numpy(), "dbeta": dbeta.numpy(),
            "moving_mean": layer.moving_mean.numpy(), "moving_variance": layer.moving_variance.numpy(),
            "inference": layer(x, training=False).numpy()}


@scenario
def tf_sync_batch_norm(out, args):
    """SyncBatchNormalization (eager and in a tf.function) against Keras's BatchNormalization of every
    rank's batch concatenated: this rank's rows of the output and of the input gradient, gamma/beta
    gradients (this rank's share; the test adds them up), moving statistics."""
    tf = _tf()
    import keras

    import byteps.tensorflow as bps
    import byteps.tensorflow.keras as bps_keras

    bps.init()
    r, n = bps.rank(), bps.size()
    every = [batch(q) for q in range(n)]
    first = sum(len(b) for b in every[:r])
    upstream_all = np.random.default_rng(5).normal(size=(sum(len(b) for b in every), 4, CHANNELS))
    res = {"same_class": bps_keras.SyncBatchNormalization is bps.SyncBatchNormalization,
           "fused_error": _fused_error(bps), "first": first, "rows": len(every[r])}
    x, up = tf.constant(every[r]), tf.constant(upstream_all[first:first + len(every[r])])
    want = _bn_results(tf, keras.layers.BatchNormalization(momentum=0.5, dtype="float64"),
                       tf.constant(np.concatenate(every)), tf.constant(upstream_all), False)
    res["want"] = {k: v.tolist() for k, v in want.items()}
    for mode, traced in (("eager", False), ("function", True)):
        got = _bn_results(tf, bps.SyncBatchNormalization(momentum=0.5, dtype="float64"), x, up, traced)
        res[mode] = {k: v.tolist() for k, v in got.items()}
    return res


def _fused_error(bps):
    try:
        bps.SyncBatchNormalization(fused=True)
        return "no error"
    except ValueError as e:
        return str(e)


@scenario
def tf_elastic_state(out, args):
    """TensorFlowState and TensorFlowKerasState: sync takes rank 0's variables and attributes, restore goes
    back to the last commit (or sync), commit keeps the current values; ``run`` syncs first."""
    tf = _tf()
    import keras

    import byteps.tensorflow as bps

    bps.init()
    r = bps.rank()
    res = {}
    variables = [tf.Variable(np.full((2, 2), r + 1.0)), tf.Variable(np.arange(3.0) * (r + 1))]
    state = bps.elastic.TensorFlowState(variables, batch=20 + r, epoch=10 + r)
    state.sync()
    res["synced"] = ([v.numpy().tolist() for v in variables], state.batch, state.epoch)
    for v in variables:
        v.assign(v * 0 + 7.0)
    state.batch = 99
    state.restore()
    res["restored"] = ([v.numpy().tolist() for v in variables], state.batch)
    for v in variables:
        v.assign(v * 0 + 5.0 + r)
    state.batch = 21
    state.commit()
    for v in variables:
        v.assign(v * 0 - 1.0)
    state.restore()
    res["committed"] = ([v.numpy().tolist() for v in variables], state.batch)

    keras.utils.set_random_seed(100 + r)  # different initial weights on each rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.optimizer.build(model.trainable_variables)
    keras_state = bps.elastic.TensorFlowKerasState(model, epoch=r)

    @bps.elastic.run
    def train(state, steps):
        start = [w.tolist() for w in state.model.get_weights()]
        x, y = np.ones((4, 3)) * (r + 1), np.zeros((4, 2))
        for _ in range(steps):
            state.model.train_on_batch(x, y)
        trained = [w.tolist() for w in state.model.get_weights()]
        state.restore()
        return start, trained, [w.tolist() for w in state.model.get_weights()], state.epoch

    res["keras"] = train(keras_state, 2)
    res["callbacks"] = _fit_with_elastic_callbacks(keras, bps, model, r)
    return res


def _fit_with_elastic_callbacks(keras, bps, model, r):
    """One epoch of 3 batches with Horovod's elastic Keras callbacks, committing every 2 batches: the state's
    batch and epoch after fit, then after restore (the commit at batch index 1), the weights at that batch."""
    import byteps.keras

    elastic = byteps.keras.elastic
    state = elastic.KerasState(model, batch=0, epoch=0)
    state.sync()
    seen = {}

    class Record(keras.callbacks.Callback):
        def on_batch_end(self, batch, logs=None):
            seen[batch] = [w.tolist() for w in model.get_weights()]

    callbacks = [elastic.UpdateBatchStateCallback(state), elastic.CommitStateCallback(state, batches_per_commit=2),
                 elastic.UpdateEpochStateCallback(state), Record()]
    model.fit(np.ones((6, 3)) * (r + 1), np.zeros((6, 2)), batch_size=2, epochs=1, verbose=0, shuffle=False,
              callbacks=callbacks)
    after_fit = [state.batch, state.epoch]
    state.restore()
    return {"after_fit": after_fit, "restored": [state.batch, state.epoch],
            "weights_are_batch_1": [w.tolist() for w in model.get_weights()] == seen[1],
            "weights_are_batch_2": [w.tolist() for w in model.get_weights()] == seen[2]}


@scenario
def tf_one_rank_refuses(out, args):
    """Rank 1 gives an alltoall splits that cannot be right (eagerly, then inside a tf.function); rank 0's are
    fine. Returns, per attempt, each rank's error and how long it took; then an unnamed alltoall and a named
    push_pull, which must pair up (automatic names in step after the error). No barrier in between: the
    failure must not depend on the scheduler seeing the ranks blocked in different collectives."""
    import time

    tf = _tf()

    import byteps.tensorflow as bps

    bps.init()
    r, n = bps.rank(), bps.size()
    x = tf.range(2 * n, dtype=tf.float32) + 100 * r
    bad = [3, -1] + [2] * (n - 2) if r == 1 else [2] * n
    res = {}
    for mode, call in (("eager", lambda s: bps.alltoall(x, splits=s)),
                       ("function", tf.function(lambda s: bps.alltoall(x, splits=s)))):
        start = time.monotonic()
        try:
            call(tf.constant(bad, tf.int32))
            res[mode] = ["no error", time.monotonic() - start]
        except Exception as e:  # the test reads the text
            res[mode] = [f"{type(e).__name__}: {e}", time.monotonic() - start]
    res["after"] = [bps.alltoall(x).numpy().tolist(), bps.push_pull(x, name="after", op=bps.Sum).numpy().tolist()]
    return res
