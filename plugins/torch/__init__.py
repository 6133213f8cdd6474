"""byteps for PyTorch: ``import byteps.torch as bps`` -- or, for a Horovod script, ``as hvd``.

BytePS's API (push_pull, DistributedOptimizer, broadcast_parameters, ...), Horovod's ``horovod.torch``
names and semantics (mpi_ops.py), a DDP communication hook and a ``torch.distributed`` backend named
``"byteps"`` (process_group.py). See README.md and docs/launchers.md."""
from byteps import common as _common
from byteps.common import barrier as _bps_barrier  # noqa: F401  (byteps' own barrier, kept importable)
from byteps.common import is_initialized, local_rank, local_size, metrics, rank, size

from . import completion as _completion
from . import mpi_ops as _mpi_ops
from . import process_sets as _process_sets
from .compression import Compression
from .ddp import ddp_comm_hook
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet, Sum,
                      UnsupportedTypeError, add_process_set, allgather, allgather_async, allreduce, allreduce_,
                      allreduce_async, allreduce_async_, barrier, broadcast, broadcast_async,
                      ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                      global_process_set, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                      grouped_allreduce_async_, is_homogeneous, join, mpi_built, mpi_enabled, mpi_threads_supported,
                      mark_step, nccl_built, remove_process_set, rocm_built, start_timeline, stop_timeline)
from .collectives import (alltoall, alltoall_async, grouped_allgather, grouped_allgather_async, grouped_reducescatter,
                          grouped_reducescatter_async, reducescatter, reducescatter_async, sparse_allreduce_async)
from .ops import (broadcast_, broadcast_async_, declare, poll, push_pull, push_pull_async, push_pull_async_inplace,
                  push_pull_inplace, synchronize)
from .optimizer import DistributedOptimizer, _DistributedOptimizer  # noqa: F401  (BytePS exports it)
from .sync_batch_norm import SyncBatchNorm
from byteps.elastic import get_pushpull_speed, resume, suspend
from .process_group import ProcessGroupBytePS
from .process_group import register as _register_backend

byteps_push_pull = push_pull_async_inplace  # BytePS's exported alias


def init(comm=None, process_sets=None, lazy=False):
    """Join the job described by the environment (bpslaunch, torchrun, mpirun, horovodrun; docs/launchers.md).

    ``comm`` and ``process_sets`` are Horovod's: ``comm`` may be None or the list of every rank
    (sub-communicators are not supported); ``process_sets`` a list of ``ProcessSet`` (or rank lists),
    numbered 1, 2, ... in order and the same on every rank, or ``"dynamic"`` (accepted: sets can be
    added after ``init()`` either way). ``lazy`` is BytePS's, ignored.
    """
    fresh = not _common.is_initialized()  # init() of an initialized job changes nothing, as Horovod's
    _common.init(lazy=lazy)
    if fresh:
        _process_sets.init_sets(process_sets)
    if comm is not None:
        ranks = sorted(comm) if isinstance(comm, (list, tuple)) else None
        if ranks != list(range(_common.size())):
            raise NotImplementedError("byteps: init(comm=...) must name every rank of the job "
                                      f"(0..{_common.size() - 1}); sub-communicators are not supported")


def shutdown():
    """Leave the job (collective); ``init()`` works again afterwards. Pending handles are forgotten."""
    _common.shutdown()
    _completion.reset()
    _mpi_ops._reset()
    _process_sets._reset()


_register_backend()

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "is_homogeneous", "barrier", "join", "metrics",
           # BytePS
           "push_pull", "push_pull_async", "push_pull_async_inplace", "push_pull_inplace", "byteps_push_pull",
           "broadcast_", "broadcast_async_", "poll", "synchronize", "declare", "broadcast_parameters",
           "broadcast_optimizer_state", "broadcast_object", "allgather_object", "Compression",
           "DistributedOptimizer", "suspend", "resume", "get_pushpull_speed",
           # Horovod
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "broadcast",
           "broadcast_async", "allgather", "allgather_async", "reducescatter", "reducescatter_async",
           "alltoall", "alltoall_async", "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "sparse_allreduce_async",
           "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "UnsupportedTypeError",
           "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "SyncBatchNorm",
           "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
           "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
           "mark_step",
           # DDP
           "ddp_comm_hook", "ProcessGroupBytePS"]
