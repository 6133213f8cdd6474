"""Broadcast helpers: variables and arbitrary picklable objects."""
import pickle

import numpy as np
import tensorflow as tf

from byteps import common
from byteps.core import dtypes

from .ops import broadcast_group, check_global_set


def _broadcast_values(variables, root_rank, prefix):
    """root_rank's values of ``variables``, broadcast ``<prefix><i>`` (i: position in the list)."""
    return broadcast_group([tf.convert_to_tensor(v) for v in variables], root_rank,
                           [f"{prefix}{i}" for i in range(len(variables))])


def broadcast_variables(variables, root_rank, prefix="BroadcastVariables."):
    """Overwrite every variable in ``variables`` with root_rank's value (in place); all at once.

    Works on ``tf.Variable`` and Keras variables, eagerly or inside ``tf.function``. Broadcast
    ``i`` is named ``<prefix><i>`` (i: position in ``variables``), so the list must hold the same
    variables in the same order on every worker; workers whose variables differ in shape or dtype
    all get an error naming the tensor. Variable names are deliberately not used: Keras numbers
    them per process (``dense_3/kernel``), so they differ between workers that built different
    numbers of layers before, and a name only some workers use waits for BYTEPS_TIMEOUT.
    """
    variables = list(variables)
    if not variables:
        return None
    values = _broadcast_values(variables, root_rank, prefix)
    if not tf.executing_eagerly() and not tf.inside_function():  # a TF1 graph: the assignments, as one op
        return tf.group(*[tf.compat.v1.assign(v, x) for v, x in zip(variables, values)])
    for v, x in zip(variables, values):
        v.assign(x)  # inside tf.function, automatic control dependencies run the assignments


_object_counter = [0]


def _bcast_numpy(arr, root_rank, name):
    code = dtypes.INT64 if arr.dtype == np.int64 else dtypes.UINT8
    h = common.submit(name, arr.reshape(-1).view(np.uint8), code, tuple(arr.shape), broadcast_root=root_rank,
                      finalize=lambda: arr)
    return common.synchronize(h)


def broadcast_object(obj, root_rank=0, name=None):
    """Return root_rank's ``obj`` on every worker (pickled on the root, unpickled elsewhere).

    Only authenticated job members can take part (docs/architecture.md); never use it with a
    root you do not trust, since unpickling runs code.
    """
    if name is None:
        name = f"tf.broadcast_object.{_object_counter[0]}"
        _object_counter[0] += 1
    me = common.rank()
    if not 0 <= root_rank < common.size():
        raise ValueError(f"byteps: root rank {root_rank} is outside 0..{common.size() - 1}")
    if me == root_rank:
        payload = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=np.uint8)
        length = np.array([payload.size], dtype=np.int64)
    else:
        length = np.zeros(1, dtype=np.int64)
    _bcast_numpy(length, root_rank, f"{name}.size")
    if me != root_rank:
        payload = np.empty(int(length[0]), dtype=np.uint8)
    _bcast_numpy(payload, root_rank, f"{name}.data")
    if me == root_rank:
        return obj
    return pickle.loads(payload.tobytes())


def allgather_object(obj, name=None):
    """A list with every rank's ``obj``, in rank order (one broadcast per rank)."""
    base = name or f"tf.allgather_object.{_object_counter[0]}"
    _object_counter[0] += 1
    return [broadcast_object(obj, root, name=f"{base}.{root}") for root in range(common.size())]


def broadcast_(variables, root_rank, name=None, process_set=None):
    """Horovod's in-place broadcast: assign root_rank's values to ``variables``; returns them."""
    check_global_set(process_set)
    variables = list(variables)
    values = _broadcast_values(variables, root_rank, f"{name or 'broadcast_'}.")
    assigned = [v.assign(x) for v, x in zip(variables, values)]
    return variables if tf.executing_eagerly() else assigned  # in a graph: the assignments' new values


def broadcast_global_variables(root_rank):
    """TF1 graphs: broadcast every global variable from ``root_rank`` (Horovod's). Eager mode has no global
    variables: RuntimeError, as Horovod (use broadcast_variables(model.variables, root_rank))."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. "
                           "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    variables = tf.compat.v1.global_variables()
    if not variables:
        return tf.no_op()
    values = _broadcast_values(variables, root_rank, "BroadcastGlobalVariables.")
    return tf.group(*[tf.compat.v1.assign(v, x) for v, x in zip(variables, values)])


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=None):
    """Horovod's: a function ``fn(obj)`` that returns root_rank's ``obj`` (``session`` is not needed)."""
    check_global_set(process_set)
    return lambda obj: broadcast_object(obj, root_rank, name=name)
