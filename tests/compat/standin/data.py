"""Small stand-in MNIST files in the formats the examples' loaders read, written by the harness before an
example runs: IDX files for torchvision (``<dir>/MNIST/raw``) and Keras's ``mnist.npz`` layout
(``x_train``, ``y_train``, ``x_test``, ``y_test``) under ``$KERAS_HOME/datasets``.

The images are 28 x 28 uint8 with labels 0-9: each digit a fixed random pattern plus noise, so that
a model can learn them; sizes are small so that an example's epoch takes seconds.
"""
import os
import struct

import numpy as np

TRAIN, TEST = 512, 128


def mnist_arrays(seed=0):
    """((x_train, y_train), (x_test, y_test)) as MNIST's dtypes and shapes, TRAIN and TEST samples."""
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 256, size=(10, 28, 28))

    def sample(n):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        noise = rng.integers(-40, 41, size=(n, 28, 28))
        return np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8), labels

    return sample(TRAIN), sample(TEST)


def _write_idx(path, arr):
    with open(path, "wb") as f:
        f.write(b"\x00\x00\x08" + bytes([arr.ndim]) + struct.pack(f">{arr.ndim}i", *arr.shape))
        f.write(np.ascontiguousarray(arr, dtype=np.uint8).tobytes())


def write_torchvision_mnist(root):
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    (xtr, ytr), (xte, yte) = mnist_arrays()
    for name, arr in (("train-images-idx3-ubyte", xtr), ("train-labels-idx1-ubyte", ytr),
                      ("t10k-images-idx3-ubyte", xte), ("t10k-labels-idx1-ubyte", yte)):
        _write_idx(os.path.join(raw, name), arr)


def write_keras_mnist(keras_home, names):
    """The stand-in ``mnist.npz`` under each file name in ``names`` (the examples pass their own)."""
    folder = os.path.join(keras_home, "datasets")
    os.makedirs(folder, exist_ok=True)
    (xtr, ytr), (xte, yte) = mnist_arrays()
    for name in names:
        with open(os.path.join(folder, name), "wb") as f:  # a file object: np.savez adds no ".npz"
            np.savez(f, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
