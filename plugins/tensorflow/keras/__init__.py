"""byteps for Keras 3 models: ``import byteps.tensorflow.keras as hvd`` (or ``byteps.keras``).

What Horovod's ``horovod.tensorflow.keras`` and BytePS's ``byteps.tensorflow.keras`` scripts import:
the basics, ``DistributedOptimizer``, ``load_model``, numpy-valued collectives and :mod:`.callbacks`.
What Keras 3 no longer allows is listed in docs/compat.md."""
import numpy as np
import tensorflow as tf

from byteps.common import barrier, init, is_initialized, local_rank, local_size, rank, shutdown, size

from .. import collectives as _collectives, ops as _ops
from ..compression import Compression
from ..functions import allgather_object, broadcast_object, broadcast_variables
from ..ops import Average, Sum
from ..optimizer import DistributedOptimizer as _distributed_optimizer
from ..sync_batch_norm import SyncBatchNormalization
from . import callbacks, elastic

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "barrier",
           "Average", "Sum", "Compression", "DistributedOptimizer", "load_model", "broadcast_global_variables",
           "allreduce", "push_pull", "allgather", "broadcast", "reducescatter", "broadcast_variables",
           "broadcast_object", "allgather_object", "callbacks", "elastic", "SyncBatchNormalization"]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None, process_set=None,
                         scale_local_gradients=True):
    """Wrap a Keras 3 optimizer so that ``model.fit`` averages the gradients over all workers first
    (Horovod's signature; :func:`byteps.tensorflow.DistributedOptimizer` does the work).

    ``num_groups``/``groups`` (fusion hints: byteps partitions and schedules tensors itself) and
    ``scale_local_gradients`` are accepted; ``process_set`` must be the global set.
    """
    _ops.check_global_set(process_set)
    return _distributed_optimizer(optimizer, name=name, compression=compression, op=op,
                                  backward_passes_per_step=backward_passes_per_step, device_dense=device_dense,
                                  device_sparse=device_sparse, sparse_as_dense=sparse_as_dense,
                                  gradient_predivide_factor=gradient_predivide_factor,
                                  average_aggregated_gradients=average_aggregated_gradients)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """``keras.models.load_model`` whose restored optimizer (with its state) averages gradients over
    all workers, as Horovod's and BytePS's ``load_model``.

    ``custom_optimizers``: optimizer classes the file may name besides Keras' own; ``custom_objects``
    as for Keras. Every worker loads the file itself.
    """
    import keras

    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression)
    return model


def broadcast_global_variables(root_rank):
    """Not available: Keras 3 and TF 2 eager have no global variable collection (Horovod raises too).
    Use ``callbacks.BroadcastGlobalVariablesCallback(root_rank)`` in ``fit``, or
    ``broadcast_variables(model.variables + optimizer.variables, root_rank)``."""
    raise RuntimeError("broadcast_global_variables() needs TF1 graph collections, which Keras 3 and TensorFlow 2 "
                       "eager mode do not have; use callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                       "broadcast_variables(model.variables + model.optimizer.variables, root_rank)")


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Average (or sum) a value over all workers; returns a numpy array (Horovod's keras ``allreduce``)."""
    return np.asarray(_collectives.allreduce(tf.convert_to_tensor(value), average=average, name=name,
                                             compression=compression, op=op, prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor))


def push_pull(value, name=None, average=True):
    """BytePS's keras ``push_pull``: :func:`allreduce` with ``average`` (default True)."""
    return allreduce(value, name=name, average=average)


def broadcast(value, root_rank, name=None):
    """``root_rank``'s value on every worker, as a numpy array."""
    return np.asarray(_ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name))


def allgather(value, name=None):
    """Every worker's value concatenated along dim 0 in rank order (dim 0 may differ), as numpy."""
    parts = allgather_object(np.atleast_1d(np.asarray(value)), name=None if name is None else f"allgather.{name}")
    return np.concatenate(parts)


def reducescatter(value, name=None, op=Average):
    """Reduce over all workers, then keep this worker's block of dim 0 (the first ``dim0 % size``
    workers get one extra row, as Horovod)."""
    total = allreduce(value, name=name, op=op)
    n, me = size(), rank()
    rows = total.shape[0]
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    start = sum(counts[:me])
    return total[start:start + counts[me]]
