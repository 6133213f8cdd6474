"""DistributedOptimizer: push_pull each gradient as soon as back-propagation produces it."""
import contextlib
import warnings

import torch

from byteps import common

from .compression import Compression
from .ops import push_pull_async_inplace, synchronize


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
            names = [n for n, _ in named_parameters]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(f"DistributedOptimizer: parameter names must be unique; repeated: {dups}")
            known = {id(p) for _, p in named_parameters}
            unnamed = [i for i, p in enumerate(all_params) if id(p) not in known]
            if unnamed:
                raise ValueError(f"DistributedOptimizer: named_parameters lacks {len(unnamed)} optimizer "
                                 f"parameter(s) (positions {unnamed[:10]}); pass model.named_parameters()")
            self._names = {id(p): n for n, p in named_parameters}
        else:
            self._names = {id(p): f"noname.{i}" for i, p in enumerate(all_params)}
        self.backward_passes_per_step = backward_passes_per_step
        self._passes = {}
        self._handles = {}       # param -> (handle, compressed tensor, ctx)
        self._synchronized = False
        self._should_synchronize = True
        self._warned = False
        self._hooks = []
        if common.size() > 1:
            for p in all_params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes

    def _push(self, p):
        compressed, ctx = self._compression.compress(p.grad)
        handle = push_pull_async_inplace(compressed, average=True, name="Gradient." + self._names[id(p)])
        self._handles[p] = (handle, compressed, ctx)

    def _on_grad(self, p):
        if p in self._handles:
            raise RuntimeError(f"gradient of {self._names[id(p)]!r} was computed twice before step(); "
                               "use backward_passes_per_step or call synchronize() between backward passes")
        count = self._passes.get(p, 0) + 1
        if count < self.backward_passes_per_step:
            self._passes[p] = count
            return
        self._passes[p] = 0
        self._push(p)

    def synchronize(self):
        """Wait for every gradient's push_pull; gradients a worker did not compute are sent as zeros."""
        if common.size() > 1:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p not in self._handles:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        self._push(p)
        for p, (handle, compressed, ctx) in self._handles.items():
            synchronize(handle)
            out = self._compression.decompress(compressed, ctx)
            if out is not p.grad:
                p.grad.copy_(out)
        self._handles.clear()
        self._passes.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block, ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized and not self._handles and not self._warned:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): gradients may be reduced twice", stacklevel=2)
                self._warned = True
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1):
    """Wrap ``optimizer`` so that gradients are averaged over all workers before each step.

    Each gradient's push_pull starts from a hook as soon as back-propagation has accumulated it,
    so communication overlaps the rest of the backward pass; ``step()`` waits for them all.

    Args:
        optimizer: a torch optimizer (its class is subclassed; its param groups are reused).
        named_parameters: ``model.named_parameters()``, so gradients get stable, readable names.
        compression: ``Compression.none`` or ``Compression.fp16``.
        backward_passes_per_step: local backward passes accumulated before each push_pull.
    """
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)
