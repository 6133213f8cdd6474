"""Data-parallel Keras training (TensorFlow 2, Keras 3) on synthetic data with byteps.

Run it on one machine with 2 workers and 2 Summation Service servers:

    bpslaunch --local --workers 2 --servers 2 -- python examples/train_tensorflow.py

Each worker fits a small MLP on its own shard of a synthetic regression task with ``model.fit``;
``bps.DistributedOptimizer`` averages the gradients through the Summation Service before every
update, ``BroadcastGlobalVariablesCallback`` starts every worker from rank 0's weights, and
``MetricAverageCallback`` averages the epoch's loss over the workers. The model is compiled with
``jit_compile=False``: the transfer runs in a ``tf.py_function``, which XLA cannot compile.
At the end it checks that the final weights are bit-identical on every worker (exit status 1
otherwise).
"""
import argparse
import hashlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import byteps.tensorflow as bps  # noqa: E402


def make_data(rank, n, dim, seed=0):
    """A fixed random "teacher" network plus noise; a different shard on each worker."""
    t = np.random.default_rng(seed)
    w1, w2 = t.normal(0, 0.5, (dim, 64)), t.normal(0, 0.5, (64, 1))
    g = np.random.default_rng(seed + 1 + rank)
    x = g.normal(size=(n, dim))
    y = np.tanh(x @ w1) @ w2 + 0.01 * g.normal(size=(n, 1))
    return x.astype(np.float32), y.astype(np.float32)


class StepTimer(keras.callbacks.Callback):
    def __init__(self, batch_size):
        super().__init__()
        self.batch_size = batch_size
        self.samples = 0
        self.seconds = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        elapsed = time.perf_counter() - self.start
        n = self.params["steps"] * self.batch_size * bps.size()
        self.samples += n
        self.seconds += elapsed
        if bps.rank() == 0:  # logs["loss"] is already averaged over workers by MetricAverageCallback
            print(f"epoch {epoch:2d}  loss {logs['loss']:.5f}  {n / elapsed:8.0f} samples/s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="steps per epoch")
    ap.add_argument("--batch-size", type=int, default=64, help="per worker")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.02)
    args = ap.parse_args()

    bps.init()
    keras.utils.set_random_seed(1234 + bps.rank())  # deliberately different inits: the callback fixes that
    model = keras.Sequential([keras.Input((args.dim,)), keras.layers.Dense(args.hidden, activation="relu"),
                              keras.layers.Dense(args.hidden, activation="relu"), keras.layers.Dense(1)])
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)

    x, y = make_data(bps.rank(), args.batch_size * args.steps, args.dim)
    timer = StepTimer(args.batch_size)
    hist = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
                     callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0),
                                bps.callbacks.MetricAverageCallback(), timer])

    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()
    digests = bps.allgather_object(digest)
    same = len(set(digests)) == 1
    losses = hist.history["loss"]
    if bps.rank() == 0:
        print(f"trained {args.epochs} epochs x {args.steps} steps on {bps.size()} workers in {timer.seconds:.2f} s "
              f"({timer.samples / timer.seconds:.0f} samples/s); loss {losses[0]:.5f} -> {losses[-1]:.5f}")
        print(f"final weights identical on all {bps.size()} workers: {same} (sha256 {digest[:16]})", flush=True)
    bps.shutdown()
    if not same:
        print(f"weights differ across workers: {digests}",
              file=sys.stderr)
        sys.exit(1)
    if not tf.math.is_finite(losses[-1]) or losses[-1] >= losses[0]:
        print(f"loss did not fall: {losses}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
