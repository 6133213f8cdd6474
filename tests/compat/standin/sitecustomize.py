"""Run at interpreter start for the examples (tests/compat/examples.py puts this folder on PYTHONPATH):
Keras's MNIST loader reads the stand-in ``$KERAS_HOME/datasets/<path>`` that the harness wrote.

Keras checks a downloaded file against MNIST's SHA-256 and downloads it again when it differs, which a
machine without internet cannot; so once ``keras.src.datasets.mnist`` is imported, its ``get_file``
returns the local file. Nothing else changes, and nothing is imported early.
"""
import importlib.abc
import importlib.util
import os
import sys

_MODULE = "keras.src.datasets.mnist"


def _local_file(fname=None, origin=None, **_unused):
    from keras.src.backend.config import keras_home

    path = os.path.join(keras_home(), "datasets", fname)
    if not os.path.exists(path):
        raise FileNotFoundError(f"stand-in MNIST: {path} was not written (tests/compat/standin/data.py)")
    return path


class _PatchMnist(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.get_file = _local_file

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchMnist())
