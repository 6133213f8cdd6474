"""Horovod's ``hvd.elastic`` of its Keras modules: ``KerasState`` and the callbacks that keep a state's
batch and epoch current and commit it during ``model.fit``; ``run`` is :func:`byteps.tensorflow.elastic.run`.
``UpdateBatchStateCallback`` only records the batch (docs/compat.md)."""
import keras

from ..elastic import TensorFlowKerasState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """A Keras 3 ``model``, its ``optimizer`` (default ``model.optimizer``) and keyword attributes."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` after every ``batches_per_commit`` batches."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class _StateCallback(keras.callbacks.Callback):
    """A callback that keeps a field of an elastic ``state`` current."""

    def __init__(self, state):
        super().__init__()
        self.state = state


class UpdateBatchStateCallback(_StateCallback):
    """``state.batch``: the index of the last batch done in this epoch (0 again at the epoch's end)."""

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_StateCallback):
    """``state.epoch``: the index of the last epoch done."""

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch
