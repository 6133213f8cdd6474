"""Keras callbacks: start every worker from the same state, average the epoch's metrics."""
import keras
import numpy as np

from byteps import common
from byteps.core import dtypes

from .functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, overwrite the model's weights and the optimizer's variables with
    ``root_rank``'s, so that every worker starts from the same state.

    Keras 3 optimizers create their variables lazily; this callback builds the optimizer first
    (``optimizer.build(model.trainable_variables)``) so that its state is broadcast too. Runs once
    (the first ``fit``), unless :attr:`broadcast_done` is reset.
    """

    def __init__(self, root_rank=0, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        broadcast_variables(model.weights, self.root_rank, prefix="BroadcastGlobalVariables.model.")
        opt = getattr(model, "optimizer", None)
        if opt is not None:
            if not opt.built:
                opt.build(model.trainable_variables)
            broadcast_variables(opt.variables, self.root_rank, prefix="BroadcastGlobalVariables.optimizer.")
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace every metric in ``logs`` by its average over the workers.

    Put it before callbacks that read the metrics (checkpoints, early stopping, LR schedules) in
    the ``callbacks`` list. Every worker must log the same metric names.
    """

    def __init__(self, device=""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or common.size() <= 1:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype,
                                                                                         np.number))
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        # one tensor per key set, named by the keys so that a different set gets its own tensor
        name = "MetricAverageCallback." + ",".join(keys)
        h = common.submit(name, values.view(np.uint8), dtypes.FLOAT64, values.shape, finalize=lambda: values)
        total = common.synchronize(h)
        for k, v in zip(keys, total / common.size()):
            logs[k] = float(v)
