"""byteps.tensorflow.keras / byteps.keras scenarios for tests/test_keras_compat.py (Horovod's and
BytePS's Keras module, Keras 3). TensorFlow is imported inside the scenario only."""
import os

import numpy as np

from scenarios_tf import _err, _fit_data, _make_model, _tf, scenario

BASE_LR = 0.05
PER_WORKER, STEPS, EPOCHS = 4, 5, 4
WARMUP_EPOCHS, HALVE_FROM = 2, 3


def fit_rows(r, n):
    """Rows of the combined data that worker ``r`` trains on: its slice of every combined batch."""
    B = PER_WORKER
    return np.concatenate([np.arange(s * n * B + r * B, s * n * B + (r + 1) * B) for s in range(STEPS)])


@scenario
def keras_api(out, args):
    _tf()
    import keras

    import byteps.keras as bk
    import byteps.tensorflow.keras as hvd

    keras.config.set_floatx("float64")
    r, n = hvd.rank(), hvd.size()
    res = {"same_api": bk.DistributedOptimizer is hvd.DistributedOptimizer and bk.load_model is hvd.load_model
           and bk.callbacks.LearningRateWarmupCallback is hvd.callbacks.LearningRateWarmupCallback}

    # ---------------------------------------------------------------- value collectives (numpy in, numpy out)
    base = np.arange(10.0).reshape(5, 2)
    res["allreduce"] = hvd.allreduce(base * (r + 1), name="k.allreduce").tolist()
    res["allreduce_sum"] = hvd.allreduce(base * (r + 1), name="k.allreduce_sum", op=hvd.Sum).tolist()
    res["push_pull"] = hvd.push_pull(base * (r + 1), name="k.push_pull", average=False).tolist()
    res["broadcast"] = hvd.broadcast(base * (r + 1), n - 1, name="k.broadcast").tolist()
    res["allgather"] = hvd.allgather(np.full((r + 1, 2), float(r)), name="k.allgather").tolist()
    res["reducescatter"] = hvd.reducescatter(base * (r + 1), name="k.reducescatter", op=hvd.Sum).tolist()
    res["broadcast_global_variables"] = _err(lambda: hvd.broadcast_global_variables(0))

    # ---------------------------------------------------------------- predivide factor, averaged passes
    v = keras.Variable(np.zeros(3))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                   average_aggregated_gradients=True, gradient_predivide_factor=2.0)
    for k in range(2):
        opt.apply([np.array([1.0, 2.0, 3.0]) * (r + 1) * (k + 1)], [v])
    res["passes"] = np.asarray(v).tolist()

    # ---------------------------------------------------------------- fit with every callback
    x, y = (a.astype(np.float64) for a in _fit_data(PER_WORKER, STEPS, n))
    rows = fit_rows(r, n)
    model = _make_model(keras, seed=2000 + r)  # different initial weights: the broadcast callback fixes them
    init_weights = [w.copy() for w in model.get_weights()]
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=BASE_LR)), loss="mse",
                  jit_compile=False)
    lrs = []

    class RecordRate(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    hist = model.fit(x[rows], y[rows], batch_size=PER_WORKER, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=BASE_LR, warmup_epochs=WARMUP_EPOCHS),
        bk.callbacks.LearningRateScheduleCallback(initial_lr=BASE_LR, multiplier=0.5, start_epoch=HALVE_FROM),
        RecordRate()])
    res["fit"] = {"weights": [w.tolist() for w in model.get_weights()], "loss": hist.history["loss"],
                  "lr_log": hist.history["lr"], "lrs": lrs}
    if r == 0:  # the reference: rank 0's initial weights, one process, combined batches, the same rates
        ref = _make_model(keras, seed=2000)
        ref.set_weights(init_weights)
        ref.compile(optimizer=keras.optimizers.SGD(learning_rate=BASE_LR), loss="mse", jit_compile=False)
        step = iter(lrs)

        class SameRate(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.model.optimizer.learning_rate = next(step)

        rh = ref.fit(x, y, batch_size=PER_WORKER * n, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[SameRate()])
        res["fit"]["ref_weights"] = [w.tolist() for w in ref.get_weights()]
        res["fit"]["ref_loss"] = rh.history["loss"]

    # ---------------------------------------------------------------- load_model re-wraps the optimizer
    path = os.path.join(out, "model.keras")
    if r == 0:
        model.save(path)
    hvd.barrier()
    loaded = (hvd if r % 2 == 0 else bk).load_model(path)
    opt = loaded.optimizer
    res["loaded"] = {"class": type(opt).__name__, "distributed": hasattr(opt, "_bps_op"),
                     "iterations": int(opt.iterations.numpy()),
                     "same_weights": all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(),
                                                                              model.get_weights()))}
    loaded.fit(x[rows], y[rows], batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0)
    res["loaded"]["weights"] = [w.tolist() for w in loaded.get_weights()]
    return res


@scenario
def tf_mirrored(out, args):
    """byteps.tensorflow.distribute.MirroredStrategy with model.fit (float64): weights identical on
    every worker and equal to a one-process run on the combined batches."""
    _tf()
    import keras

    import byteps.tensorflow as bps

    keras.config.set_floatx("float64")
    r, n = bps.rank(), bps.size()
    x, y = (a.astype(np.float64) for a in _fit_data(PER_WORKER, STEPS, n))
    rows = fit_rows(r, n)
    strategy = bps.distribute.MirroredStrategy()
    with strategy.scope():
        model = _make_model(keras, seed=3000 + r)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=BASE_LR, momentum=0.5), loss="mse",
                      jit_compile=False)
    init_weights = None
    hist = model.fit(x[rows], y[rows], batch_size=PER_WORKER, epochs=2, shuffle=False, verbose=0,
                     callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0)])
    res = {"replicas": strategy.num_replicas_in_sync, "weights": [w.tolist() for w in model.get_weights()],
           "loss": hist.history["loss"]}
    if r == 0:
        init_weights = _make_model(keras, seed=3000).get_weights()  # rank 0's initial weights, rebuilt
        ref = _make_model(keras, seed=3000)
        ref.set_weights(init_weights)
        ref.compile(optimizer=keras.optimizers.SGD(learning_rate=BASE_LR, momentum=0.5), loss="mse",
                    jit_compile=False)
        rh = ref.fit(x, y, batch_size=PER_WORKER * n, epochs=2, shuffle=False, verbose=0)
        res["ref_weights"] = [w.tolist() for w in ref.get_weights()]
        res["ref_loss"] = rh.history["loss"]
    return res


@scenario
def keras_lazy_model(out, args):
    """A Sequential without an input shape (Horovod's and BytePS's MNIST examples): Keras 3 builds it at the
    first batch, so BroadcastGlobalVariablesCallback acts at the end of that batch (as Horovod's)."""
    _tf()
    import keras

    import byteps.tensorflow.keras as hvd

    r, n = hvd.rank(), hvd.size()
    x, y = _fit_data(PER_WORKER, STEPS, n)
    rows = fit_rows(r, n)
    keras.utils.set_random_seed(4000 + r)  # different initial weights on every worker
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=BASE_LR, momentum=0.5)),
                  loss="mse", jit_compile=False)
    hist = model.fit(x[rows], y[rows], batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0,
                     callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {"weights": [w.tolist() for w in model.get_weights()], "loss": hist.history["loss"],
            "optimizer_variables": len(model.optimizer.variables)}
