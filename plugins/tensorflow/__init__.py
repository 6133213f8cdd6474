"""byteps for TensorFlow 2 / Keras 3: ``import byteps.tensorflow as bps``.

BytePS's and Horovod's TF API over the Summation Service: ``push_pull``/``allreduce``,
``broadcast``, ``broadcast_variables``, ``broadcast_object``, ``DistributedGradientTape`` for
custom training loops, ``DistributedOptimizer`` for Keras 3 optimizers (``model.fit``) and the
Keras callbacks in :mod:`byteps.tensorflow.callbacks`. Everything works in eager mode and inside
``tf.function`` (not under XLA: ``jit_compile=False``).
"""
from byteps.common import (barrier, init, is_initialized, local_rank, local_size, mark_step, rank, shutdown, size)

from . import callbacks, distribute
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_variables
from .ops import Average, Sum, allreduce, broadcast, broadcast_group, push_pull, push_pull_group
from .optimizer import DistributedGradientTape, DistributedOptimizer

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "barrier", "mark_step",
           "Average", "Sum", "push_pull", "allreduce", "push_pull_group", "broadcast", "broadcast_group",
           "broadcast_variables", "broadcast_object", "allgather_object", "Compression",
           "DistributedGradientTape", "DistributedOptimizer", "callbacks", "distribute"]
