"""Horovod's elastic training state for TensorFlow: ``hvd.elastic.TensorFlowState``,
``TensorFlowKerasState``, ``ObjectState`` and the ``run`` decorator.

``sync()`` gives every worker rank 0's state, ``commit()`` keeps a copy in memory, ``restore()`` goes
back to it. byteps' set of workers is fixed for a job, so ``run`` syncs the state and calls the
function once; a byteps error inside restores the last commit and is raised (docs/compat.md)."""
import copy
import functools
import itertools

import numpy as np
import tensorflow as tf

from byteps import common
from byteps.errors import BytePSError

from .functions import broadcast_object, broadcast_variables

__all__ = ["State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "run"]

_instances = itertools.count()  # construction order, the same on every worker: the broadcasts' names


class State:
    """Horovod's base state: ``commit`` saves, ``restore`` goes back, ``sync`` takes rank 0's; reset callbacks
    are kept for Horovod's API (with a fixed set of workers no reset happens)."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Save the current state in memory: the point ``restore`` returns to."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Horovod raises HostsUpdatedInterrupt here when workers were added or removed; byteps' set of workers
        is fixed for the job's life."""

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        """Called after the job changed; nothing to do with a fixed set of workers."""


class ObjectState(State):
    """Plain attributes given as keyword arguments (``ObjectState(epoch=0, batch=0)``), saved by value and
    synchronized from rank 0 with :func:`broadcast_object`."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._bcast_object = bcast_object or (lambda obj: broadcast_object(obj, root_rank=0))
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    def save(self):
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def _values(variables):
    return [np.array(v.numpy(), copy=True) for v in variables]


class _VariablesState(ObjectState):
    """Variables (``_variables()``) and keyword attributes, saved, restored and synchronized together."""

    def __init__(self, **kwargs):
        self._prefix = f"elastic.{type(self).__name__}.{next(_instances)}."
        self._saved_values = _values(self._variables())
        super().__init__(**kwargs)

    def save(self):
        self._saved_values = _values(self._variables())
        super().save()

    def restore(self):
        variables = self._variables()
        if len(variables) != len(self._saved_values):  # the optimizer built its slots after the last commit
            raise RuntimeError(f"byteps.tensorflow.elastic: the model and optimizer now have {len(variables)} "
                               f"variables, {len(self._saved_values)} when last committed; commit after the "
                               "optimizer's first step")
        for v, value in zip(variables, self._saved_values):
            v.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self._variables(), root_rank=0, prefix=self._prefix)
        self._saved_values = _values(self._variables())
        super().sync()


class TensorFlowState(_VariablesState):
    """``variables`` (tf.Variable or Keras variables) and keyword attributes. Eager mode only, as Horovod's
    TensorFlow 2 state: TensorFlow 2 has no global variable collection, so ``variables`` is required."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("byteps.tensorflow.elastic.TensorFlowState needs its variables: TensorFlow 2 has no "
                             "global variable collection to take them from")
        if not tf.executing_eagerly():
            raise RuntimeError("byteps.tensorflow.elastic.TensorFlowState works in eager mode only (as Horovod's "
                               "state on TensorFlow 2)")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def _variables(self):
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """A Keras 3 ``model``, its ``optimizer`` (default ``model.optimizer``) and keyword attributes: the
    model's and optimizer's variables are saved, restored and synchronized together."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def _variables(self):
        optimizer_variables = list(self.optimizer.variables) if self.optimizer is not None else []
        return list(self.model.variables) + optimizer_variables


def run(func):
    """Horovod's ``@hvd.elastic.run``: ``func(state, *args, **kwargs)`` starts from rank 0's state (``sync``).

    A byteps failure inside ``func`` restores the state's last commit and is raised: byteps cannot go on
    with fewer workers (Horovod would re-form the job and call ``func`` again)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not common.is_initialized():
            raise RuntimeError("byteps.tensorflow.elastic.run: call byteps.tensorflow.init() first")
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except (BytePSError, tf.errors.OpError):
            state.restore()
            raise

    return wrapper
