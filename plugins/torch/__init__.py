"""byteps for PyTorch: ``import byteps.torch as bps``.

BytePS's API (init, push_pull, DistributedOptimizer, broadcast_parameters, ...) over the
Summation Service. See README.md for a minimal training script.
"""
from byteps.common import (barrier, init, is_initialized, local_rank, local_size, rank, shutdown, size)

from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .ops import (broadcast_, broadcast_async_, declare, poll, push_pull, push_pull_async, push_pull_async_inplace,
                  push_pull_inplace, synchronize)
from .optimizer import DistributedOptimizer

byteps_push_pull = push_pull_async_inplace  # BytePS's exported alias

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "barrier",
           "push_pull", "push_pull_async", "push_pull_async_inplace", "push_pull_inplace", "byteps_push_pull",
           "broadcast_", "broadcast_async_", "poll", "synchronize", "declare", "broadcast_parameters",
           "broadcast_optimizer_state", "broadcast_object", "allgather_object", "Compression",
           "DistributedOptimizer"]
