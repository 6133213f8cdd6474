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

A CUDA bucket goes to the native core as its device memory, as any CUDA push_pull does (plugins/torch/
ops.py): the core copies it off the GPU and back partition by partition (COPYD2H / COPYH2D), so DDP's
thread only records an event and the copies overlap the network. The future completes once the last
partition is back on the GPU.
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
