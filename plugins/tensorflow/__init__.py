"""byteps for TensorFlow 2 / Keras 3: ``import byteps.tensorflow as bps``.

BytePS's and Horovod's TF API over the Summation Service: collectives, ``broadcast_variables``,
``DistributedGradientTape``, ``DistributedOptimizer`` for Keras 3 optimizers, the Keras callbacks,
``SyncBatchNormalization`` and elastic state. Eager and inside ``tf.function`` (``jit_compile=False``)."""
import os

# a TF1 session's independent ops share TF_NUM_INTEROP_THREADS threads, and each byteps op holds one until
# every worker has joined it: too few threads could deadlock two workers (docs/compat.md). A user's value is kept.
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "64")

import tensorflow as tf  # noqa: E402

from byteps import common  # noqa: E402
from byteps.common import (barrier, init, is_initialized, local_rank, local_size, mark_step, metrics, rank,
                           shutdown, size)
from byteps.build_info import (ccl_built, cuda_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,  # noqa: F401
                               nccl_built, rocm_built)

from . import callbacks, distribute, elastic
from .collectives import (allgather, allreduce, alltoall, grouped_allgather, grouped_allreduce, grouped_reducescatter,
                          push_pull, reducescatter)
from .compression import Compression
from .functions import (allgather_object, broadcast_, broadcast_global_variables, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from .ops import Adasum, Average, Max, Min, Product, Sum, broadcast, broadcast_group, push_pull_group
from .optimizer import DistributedGradientTape, DistributedOptimizer, PartialDistributedGradientTape
from .sync_batch_norm import SyncBatchNormalization


def _executing_eagerly():
    """Horovod's helper: True in eager mode."""
    return tf.executing_eagerly()


def join():
    """Horovod's join(): this rank has no more data; returns the last rank to join (see byteps.common.join)."""
    return common.join()


def rank_op(name=None):
    """This process's rank, as a tensor (Horovod's op)."""
    return tf.constant(common.rank(), dtype=tf.int32, name=name)


def size_op(process_set_id=0, name=None):
    return tf.constant(common.size(), dtype=tf.int32, name=name)


def local_rank_op(name=None):
    return tf.constant(common.local_rank(), dtype=tf.int32, name=name)


def local_size_op(name=None):
    return tf.constant(common.local_size(), dtype=tf.int32, name=name)


__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "barrier", "mark_step",
           "Average", "Sum", "push_pull", "allreduce", "push_pull_group", "broadcast", "broadcast_group",
           "broadcast_variables", "broadcast_object", "allgather_object", "Compression",
           "DistributedGradientTape", "DistributedOptimizer", "callbacks", "distribute", "elastic",
           "SyncBatchNormalization",
           # Horovod
           "Min", "Max", "Product", "Adasum", "grouped_allreduce", "allgather", "grouped_allgather", "alltoall",
           "reducescatter", "grouped_reducescatter", "broadcast_", "broadcast_global_variables",
           "broadcast_object_fn", "join", "PartialDistributedGradientTape", "rank_op", "size_op", "local_rank_op",
           "local_size_op", "mpi_built", "gloo_built", "nccl_built", "ccl_built", "cuda_built", "rocm_built", "mpi_enabled",
           "gloo_enabled", "metrics"]
