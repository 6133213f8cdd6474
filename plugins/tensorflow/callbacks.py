"""Keras callbacks: start every worker from the same state, average the epoch's metrics, warm up and
schedule the learning rate (Horovod's and BytePS's ``callbacks`` module, for Keras 3)."""
import keras
import numpy as np

from byteps import common
from byteps.core import dtypes
from byteps.log import logger

from .functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Overwrite the model's weights and the optimizer's variables with ``root_rank``'s, so that every
    worker trains from the same state.

    A model that is built when training begins is broadcast then (its Keras 3 optimizer is built
    first, ``optimizer.build(model.trainable_variables)``, so that its state goes too). A model that
    Keras builds lazily (a ``Sequential`` without an input shape) has no weights yet: it is broadcast
    at the end of the first batch, as Horovod does, when the model and the optimizer exist. Runs once
    (the first ``fit``), unless :attr:`broadcast_done` is reset.
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        # Horovod: variables each worker keeps its own value of (e.g. model-parallel layers)
        self.local_variables = {id(v) for v in (local_variables or ())}

    def _shared(self, variables):
        return [v for v in variables if id(v) not in self.local_variables]

    def _broadcast(self):
        model = self.model
        broadcast_variables(self._shared(model.weights), self.root_rank, prefix="BroadcastGlobalVariables.model.")
        opt = getattr(model, "optimizer", None)
        if opt is not None:
            if not opt.built:
                opt.build(model.trainable_variables)
            broadcast_variables(self._shared(opt.variables), self.root_rank,
                                prefix="BroadcastGlobalVariables.optimizer.")
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if not self.broadcast_done and self.model.built and self.model.weights:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


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


def _horovod_order(initial_lr=None, multiplier=None, start_epoch=0, end_epoch=None, staircase=True,
                   momentum_correction=True, steps_per_epoch=None):
    return locals()


def _byteps_order(multiplier=None, start_epoch=0, end_epoch=None, staircase=True, momentum_correction=True,
                  steps_per_epoch=None, initial_lr=None):
    return locals()


def _schedule_arguments(args, kwargs):
    """LearningRateScheduleCallback's arguments in Horovod's order, or in BytePS's when the first
    positional one is a function, is alone, or ``initial_lr`` is given by keyword beside it."""
    byteps = bool(args) and "multiplier" not in kwargs and (
        callable(args[0]) or len(args) == 1 or "initial_lr" in kwargs)
    return (_byteps_order if byteps else _horovod_order)(*args, **kwargs)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to (not
    including) ``end_epoch``, as Horovod's callback of the same name.

    ``multiplier`` is a number or a function of the epoch. With ``staircase=True`` (and always for a
    number) the rate changes at the first batch of each epoch, with the whole epoch number; with
    ``staircase=False`` at every batch, with the fractional epoch ``epoch + batch / steps_per_epoch``
    (``steps_per_epoch`` is read from ``fit`` when not given). ``initial_lr`` defaults to the
    optimizer's rate when training begins (BytePS's and older Horovod's behaviour; newer Horovod
    requires it). Both argument orders work: Horovod's ``(initial_lr, multiplier, ...)`` and
    BytePS's ``(multiplier, start_epoch, ...)`` (a callable or a lone first argument is the multiplier).

    ``momentum_correction`` is accepted but has no effect: a Keras 3 optimizer's momentum is a Python
    number compiled into the training step, so it cannot be rescaled for one batch (docs/compat.md).
    The rate is logged as ``logs["lr"]`` at each epoch's end.
    """

    def __init__(self, *args, **kwargs):
        super().__init__()
        a = _schedule_arguments(args, kwargs)
        multiplier = a["multiplier"]
        if multiplier is None:
            raise ValueError("LearningRateScheduleCallback needs a multiplier (a number or a function of the epoch)")
        self.initial_lr = a["initial_lr"]
        self.start_epoch, self.end_epoch = a["start_epoch"], a["end_epoch"]
        self.staircase = a["staircase"] or not callable(multiplier)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.momentum_correction = a["momentum_correction"]
        self.steps_per_epoch = a["steps_per_epoch"]
        self.current_epoch = None

    def _optimizer(self):
        opt = self.model.optimizer
        if isinstance(opt.learning_rate, keras.optimizers.schedules.LearningRateSchedule) or \
                isinstance(getattr(opt, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(f"{type(self).__name__} sets the optimizer's learning rate, but this optimizer "
                             "follows a LearningRateSchedule; use one or the other")
        return opt

    def on_train_begin(self, logs=None):
        opt = self._optimizer()
        if self.initial_lr is None:
            self.initial_lr = float(keras.ops.convert_to_numpy(opt.learning_rate))
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__} could not tell the number of steps per epoch from fit(); "
                                 "pass steps_per_epoch")
        if self.momentum_correction and getattr(opt, "momentum", 0):
            logger.debug("%s: momentum correction is not available with Keras 3 optimizers", type(self).__name__)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(epoch)
        else:
            self._set(epoch + batch / self.steps_per_epoch)

    def _set(self, epoch):
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warm-up ("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"): over
    ``warmup_epochs`` the rate rises linearly, batch by batch, from ``initial_lr / size()`` to
    ``initial_lr`` (reached at the end of the last warm-up epoch), where ``initial_lr`` is the rate
    scaled for all workers. Arguments as Horovod's; ``initial_lr`` defaults to the optimizer's rate
    (BytePS). ``verbose`` prints the rate reached at the end of the warm-up."""

    def __init__(self, initial_lr=None, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                 verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch  # round numbers at each epoch's end, as Horovod
            return (epoch * (common.size() - 1) / warmup_epochs + 1) / common.size()

        super().__init__(initial_lr=initial_lr, multiplier=multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")
