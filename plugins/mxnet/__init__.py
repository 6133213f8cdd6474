"""byteps for MXNet (Gluon and the Module API): ``import byteps.mxnet as bps``.

BytePS's MXNet API (init, byteps_push_pull, DistributedOptimizer, DistributedTrainer,
broadcast_parameters, ...) over the Summation Service. Supported with mxnet 1.9.1 and
numpy 1.23.5 in their own virtual environment (``make mxnet-env``); see docs/mxnet.md.
"""
from byteps.common import barrier, init, is_initialized, local_rank, local_size, metrics, rank, shutdown, size

from .compression import Compression
from .functions import broadcast_parameters
from .ops import (broadcast_, broadcast_async_, byteps_declare_tensor, byteps_push_pull, poll, push_pull,
                  push_pull_async, synchronize)
from .optimizer import DistributedOptimizer, DistributedTrainer

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "barrier", "metrics",
           "push_pull", "push_pull_async", "byteps_push_pull", "byteps_declare_tensor", "broadcast_",
           "broadcast_async_", "poll", "synchronize", "broadcast_parameters", "DistributedOptimizer",
           "DistributedTrainer", "Compression"]
