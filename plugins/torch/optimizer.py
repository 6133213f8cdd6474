"""DistributedOptimizer: push_pull each gradient as soon as back-propagation produces it."""
import contextlib
import warnings

import torch

from byteps import common

from .async_optimizer import AsyncDistributedOptimizer, _names_and_priorities
from .compression import Compression, WireCompressor, select, wire_codec
from .mpi_ops import Average, ProcessSet, Sum, _allreduce_start, _resolve_op, _wire_set
from .ops import _divide_, dtype_code, synchronize


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op=0,
                 gradient_predivide_factor=1.0, sparse_as_dense=False, fusion=False, pset=None, member=True):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._pset = pset  # None, or a process set's (id, ranks): gradients are averaged over its members
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._names, self._priority = _names_and_priorities(all_params, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._passes = {}
        self._handles = {}       # param -> (handle, compressed tensor, ctx)
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        # Horovod: on a rank outside the optimizer's process set, step() is the wrapped optimizer's alone
        self._communicates = common.size() > 1 and member
        self._fused = None
        if fusion and self._communicates:
            from byteps.fusion import FusedPushPull

            # balanced fusion buffers (byteps/fusion.py): small gradients share buffers in rank 0's
            # first-step order, and every buffer is split over the servers in the k/n proportions
            self._fused = FusedPushPull("DistributedOptimizer.fused")
        if self._communicates:
            for p in all_params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
            if pset is None:  # the job's partition size, chosen for this model (not for a set's members)
                common.expect_model(sum(p.numel() * p.element_size() for p in all_params if p.requires_grad))

    @property
    def _parameter_names(self):
        """Horovod's {parameter: name} (default names ``noname.<i>``, the same on every rank)."""
        return {p: self._names[id(p)] for group in self.param_groups for p in group["params"]}

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes

    def _push(self, p):
        grad = p.grad
        if grad.is_sparse:  # reduced densely, handed back sparse (as Horovod's sparse_as_dense)
            grad = grad.to_dense()
        compressor = select(self._compression, self._names[id(p)])  # per-tensor dicts (compression.py)
        compressed, ctx = compressor.compress(grad)
        name = "Gradient." + self._names[id(p)]
        priority = self._priority[id(p)]
        if self._fused is not None:
            if compressed.device.type != "cpu" or not compressed.is_contiguous():
                raise ValueError(f"DistributedOptimizer(fusion=True): gradient {name!r} is not a contiguous CPU "
                                 "tensor; fusion is for CPU training (use fusion=False)")
            self._fused.add(name, compressed.detach().reshape(-1).view(torch.uint8).numpy(),
                            dtype_code(compressed, name))
            self._handles[p] = (None, compressed, ctx)
            return
        # Horovod: prescale 1/f, postscale f (Average also divides by size). A CUDA gradient: the native
        # core copies it off the GPU partition by partition after an event recorded here, so autograd's
        # thread never waits for the GPU (plugins/torch/ops.py)
        f = self.gradient_predivide_factor if self.op == Average else 1.0
        handle = _allreduce_start(compressed, name, self.op, 1.0 / f, f, priority=priority,
                                  compression=wire_codec(compressor), pset=self._pset)
        self._handles[p] = (handle, compressed, ctx)

    def _on_grad(self, p):
        if p in self._handles:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally. "
                                 f"(parameter {self._names[id(p)]!r})")
        count = self._passes.get(p, 0) + 1
        if count < self.backward_passes_per_step:
            self._passes[p] = count
            return
        self._passes[p] = 0
        self._push(p)

    def synchronize(self):
        """Wait for every gradient's push_pull; gradients a worker did not compute are sent as zeros."""
        if self._communicates:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p not in self._handles:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        self._push(p)
        if self._fused is not None and self._handles:
            self._fused.synchronize()  # every gradient now holds the sum
        for p, (handle, compressed, ctx) in self._handles.items():
            if handle is None:  # fused: average here (integer gradients: floor division, as push_pull)
                out = compressed
                if self.op == Average:
                    _divide_(out, common.size())
            else:
                out = synchronize(handle)
            out = select(self._compression, self._names[id(p)]).decompress(out, ctx)
            if p.grad.is_sparse:  # Horovod: a sparse gradient is handed back sparse, sparse_as_dense or not
                p.grad = out if out.is_sparse else out.to_sparse()
            elif out is not p.grad:
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

    def load_state_dict(self, *args, **kwargs):
        self._handles.clear()
        self._passes.clear()
        self._synchronized = False
        self._should_synchronize = True
        return super(self.__class__, self).load_state_dict(*args, **kwargs)

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:  # Horovod: warn on every such step (Python shows it once per call site)
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        loss = super(self.__class__, self).step(closure)
        common.mark_step()  # the job timeline's step marker (docs/timeline.md)
        return loss

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=None, asynchronous=None, fusion=None):
    """Wrap ``optimizer`` so that gradients are averaged over all workers before each step.

    Each gradient's push_pull starts from a hook as soon as back-propagation has accumulated it,
    so communication overlaps the rest of the backward pass; ``step()`` waits for them all.

    Args:
        optimizer: a torch optimizer (its class is subclassed; its param groups are reused).
        named_parameters: ``model.named_parameters()``, so gradients get stable, readable names.
        compression: ``Compression.none`` or ``Compression.fp16`` (Horovod's, on the tensor), a wire
            compressor (``Compression.onebit(error_feedback=True)``, ``.topk``, ``.randomk``,
            ``.dithering``, ``.bf16``; docs/compression.md), or a dict {parameter name or fnmatch
            pattern: compressor}.
        backward_passes_per_step: local backward passes accumulated before each push_pull.
        op: Horovod's reduction, ``Average`` (default) or ``Sum`` (``Min``/``Max``/``Product`` work
            too); ``Adasum`` is not implemented.
        gradient_predivide_factor: Horovod's split average: gradients are multiplied by 1/f before
            the sum and by f/size after. Only with ``op=Average``.
        num_groups, groups: accepted for Horovod compatibility; byteps reduces every gradient as
            its own operation as soon as it is ready (there is no fusion to group).
        sparse_as_dense: accepted for Horovod compatibility: sparse gradients are always reduced
            densely (Horovod allgathers them unless this is set) and handed back sparse, as Horovod does.
        process_set: Horovod's: gradients are averaged (or summed) over this process set's members
            only; on the other ranks the optimizer does not communicate (as Horovod's). Not with ``fusion``.
        fusion: send gradients through balanced fusion buffers (byteps/fusion.py). ``None`` follows
            ``BYTEPS_FUSION`` (default off: every gradient is its own priority-scheduled push_pull).
            CPU gradients, ``op`` Average or Sum, no predivide factor, and no wire compressor.
        asynchronous: ``None`` follows the job (``BYTEPS_ENABLE_ASYNC``); ``True`` insists on
            asynchronous training and raises if the job is synchronous. In asynchronous mode the
            result is :func:`byteps.torch.async_optimizer.AsyncDistributedOptimizer`: workers push
            parameter deltas and pull the latest parameters, with no barrier (docs/async.md).
    """
    if asynchronous or (asynchronous is None and common.is_initialized() and common.config().enable_async):
        return AsyncDistributedOptimizer(optimizer, named_parameters)

    member = not isinstance(process_set, ProcessSet) or process_set.included()
    pset = _wire_set(process_set) if member else None
    op = _resolve_op(op, None)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if fusion is None:
        fusion = common.is_initialized() and common.config().fusion
    if fusion:
        if op not in (Average, Sum) or gradient_predivide_factor != 1.0 or pset is not None:
            raise ValueError("DistributedOptimizer(fusion=True) supports op=Average or Sum without "
                             "gradient_predivide_factor, over every rank (no process_set)")
        if isinstance(compression, (dict, WireCompressor)):
            raise ValueError("DistributedOptimizer(fusion=True) cannot be combined with a wire compressor or "
                             "per-tensor compression; use Compression.none or Compression.fp16")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, sparse_as_dense, bool(fusion), pset, member)
