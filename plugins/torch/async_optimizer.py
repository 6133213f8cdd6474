"""Asynchronous training (BYTEPS_ENABLE_ASYNC=1, docs/async.md): the servers keep the parameters.

At construction every worker push_pulls its parameters once (round 0 of each key: the servers keep
rank 0's values and return them to all). ``step()`` runs the wrapped optimizer locally, pushes each
parameter's delta ``new - old`` and continues from the servers' latest values, with no barrier."""
import contextlib

import torch

from byteps import common

from .ops import _start, synchronize


class _AsyncDistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters):
        super(self.__class__, self).__init__(params)
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            names = {id(p): n for n, p in named_parameters}
            missing = [i for i, p in enumerate(all_params) if id(p) not in names]
            if missing:
                raise ValueError(f"DistributedOptimizer: named_parameters lacks optimizer parameter(s) at "
                                 f"positions {missing[:10]}; pass model.named_parameters()")
        else:
            names = {id(p): f"noname.{i}" for i, p in enumerate(all_params)}
        self._names = names
        # parameters nearer the input first, as for gradients in synchronous mode
        self._priority = {id(p): -i for i, p in enumerate(all_params)}
        self._old = {}          # param -> the values last pulled from the servers
        if not common.config().distributed:  # a lone process without servers: plain local training
            return
        with torch.no_grad():
            pending = []
            for p in all_params:
                old = p.detach().clone(memory_format=torch.contiguous_format)
                self._old[p] = old
                pending.append((p, old, self._start(p, old)))
            for p, old, handle in pending:  # every worker now holds rank 0's parameters
                synchronize(handle)
                p.copy_(old)

    def _start(self, p, tensor):
        return _start(tensor, "AsyncParameter." + self._names[id(p)], False, self._priority[id(p)], asynchronous=True)

    def synchronize(self):
        """Nothing to wait for: asynchronous mode exchanges parameters in ``step()``."""

    def skip_synchronize(self):
        return contextlib.nullcontext()

    def step(self, closure=None):
        """Update locally, push each parameter's delta, and continue from the servers' latest values."""
        loss = super(self.__class__, self).step(closure)
        with torch.no_grad():
            pending = []
            for p, old in self._old.items():
                torch.sub(p.detach(), old, out=old)          # old now holds delta = new - old
                pending.append((p, old, self._start(p, old)))
            for p, old, handle in pending:
                synchronize(handle)                          # old now holds the latest parameters
                p.copy_(old)
        return loss


def AsyncDistributedOptimizer(optimizer, named_parameters=None):
    """Wrap ``optimizer`` for asynchronous training (requires BYTEPS_ENABLE_ASYNC=1 on every node).

    Constructing it exchanges the parameters once: every worker starts from rank 0's values.
    Use :func:`byteps.torch.DistributedOptimizer`, which returns this in asynchronous jobs.
    """
    if not common.config().enable_async:
        raise ValueError("asynchronous DistributedOptimizer needs BYTEPS_ENABLE_ASYNC=1 on every scheduler, "
                         "server and worker of the job (the servers must keep parameters instead of summing)")
    named_parameters = list(named_parameters) if named_parameters is not None else None
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_AsyncDistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters)
