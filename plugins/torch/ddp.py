"""DistributedDataParallel communication hook: DDP's gradient buckets averaged by byteps.

::

    dist.init_process_group("gloo", ...)                 # DDP's own bookkeeping group
    model = DistributedDataParallel(model)
    model.register_comm_hook(state=None, hook=bps.ddp_comm_hook)

Each ready bucket starts an asynchronous push_pull (average) of ``bucket.buffer()`` in place;
the returned Future completes, with that buffer, from byteps' completion callback, so the
backward pass is never blocked. The byteps job must be the same set of processes as DDP's group
(same size; ranks are not compared). ``state`` may be a string: it prefixes the tensor names,
which is needed only when several DDP models in one process use the hook at the same time.

A CUDA bucket is copied to page-locked host memory on DDP's thread, as any CUDA push_pull is
(ops._host_buffer). Staging it off that thread instead, as ``DistributedOptimizer`` does
(staging.py), was tried and measured slower on an H100: 0.46-0.97x DDP-gloo against 1.06-1.22x
between 2 machines, five runs each (docs/benchmarks.md, "DDP communication hook on CUDA").
"""
import torch

from . import completion
from .ops import push_pull_async_inplace


def ddp_comm_hook(state, bucket):
    """Average ``bucket.buffer()`` over every byteps worker; returns a ``torch.futures.Future[Tensor]``."""
    prefix = state if isinstance(state, str) else "ddp"
    tensor = bucket.buffer()
    fut = torch.futures.Future()
    handle = push_pull_async_inplace(tensor, average=True, name=f"{prefix}.bucket.{bucket.index()}")

    def done(outcomes):
        (result, error), = outcomes
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    completion.when_done([handle], done)
    return fut
