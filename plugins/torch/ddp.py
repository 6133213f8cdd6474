"""DistributedDataParallel communication hook: DDP's gradient buckets averaged by byteps.

::

    model = DistributedDataParallel(model)               # on DDP's own group, e.g. gloo
    model.register_comm_hook(state=None, hook=bps.ddp_comm_hook)

Each ready bucket starts an asynchronous push_pull (average) of ``bucket.buffer()`` in place; the
returned Future completes from byteps' completion callback (docs/launchers.md). ``state`` may be a
string prefixing the tensor names, needed only when several DDP models in one process use the hook."""
from .ops import push_pull_async_inplace
from .process_group import _future


def ddp_comm_hook(state, bucket):
    """Average ``bucket.buffer()`` over every byteps worker; returns a ``torch.futures.Future[Tensor]``."""
    prefix = state if isinstance(state, str) else "ddp"
    tensor = bucket.buffer()
    # in place: the result is ``tensor`` itself (ops._written_back)
    return _future([push_pull_async_inplace(tensor, average=True, name=f"{prefix}.bucket.{bucket.index()}")], tensor)
