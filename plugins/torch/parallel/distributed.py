"""BytePS's ``byteps.torch.parallel.DistributedDataParallel``: a module wrapper that averages
gradients over every worker during ``backward()``.

As in BytePS: construction broadcasts rank 0's ``state_dict``, ``forward`` rank 0's buffers
(``broadcast_buffers=True``); each gradient's push_pull starts as soon as autograd has accumulated
it, and the last one's hook waits for them all, so a plain optimizer can step after ``backward()``.
``no_sync()`` skips the reduction; ``synchronize()`` finishes a backward in which some parameters
got no gradient. For torch's own DDP, use the ``"byteps"`` backend or :func:`byteps.torch.ddp_comm_hook`."""
import contextlib
import itertools

import torch

from byteps import common

from ..compression import Compression
from ..functions import broadcast_parameters
from ..ops import push_pull_async_inplace, synchronize

_instances = itertools.count()


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module, device_ids=None, broadcast_buffers=True, compression=Compression.none,
                 **ignored):
        super().__init__()
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("byteps DistributedDataParallel takes at most one device id per process")
        self.module = module
        self.device_ids = device_ids
        self.broadcast_buffers = broadcast_buffers
        self._compression = compression
        self.require_backward_grad_sync = True
        self._prefix = f"DDP.{next(_instances)}"
        self._params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in self._params}
        self._handles = {}   # parameter -> (handle, compressed gradient, ctx)
        broadcast_parameters(module.state_dict(), root_rank=0, prefix=f"{self._prefix}.init.")
        if common.size() > 1:
            for _, p in self._params:
                p.register_post_accumulate_grad_hook(self._on_grad)
            common.expect_model(sum(p.numel() * p.element_size() for _, p in self._params))

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers and common.size() > 1:
            buffers = [(n, b) for n, b in self.module.named_buffers()]
            if buffers:
                broadcast_parameters(buffers, root_rank=0, prefix=f"{self._prefix}.buffers.")
        return self.module(*inputs, **kwargs)

    def _push(self, p):
        name = f"{self._prefix}.grad.{self._names[id(p)]}"
        compressed, ctx = self._compression.compress(p.grad)
        self._handles[p] = (push_pull_async_inplace(compressed, average=True, name=name), compressed, ctx)

    def _on_grad(self, p):
        if not self.require_backward_grad_sync:
            return
        if p in self._handles:
            raise AssertionError(f"DistributedDataParallel: parameter {self._names[id(p)]!r} got a second gradient "
                                 "before the first was reduced")
        self._push(p)
        if len(self._handles) == len(self._params):
            self.synchronize()

    def synchronize(self):
        """Wait for every gradient's push_pull; parameters with no gradient yet send zeros."""
        if common.size() == 1:
            return
        for _, p in self._params:
            if p not in self._handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._push(p)
        for p, (handle, compressed, ctx) in list(self._handles.items()):
            out = self._compression.decompress(synchronize(handle), ctx)
            if out is not p.grad:
                with torch.no_grad():
                    p.grad.copy_(out)
        self._handles.clear()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside this block, backward() does not reduce gradients (they accumulate locally)."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old
