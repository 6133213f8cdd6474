"""Asynchronous training (BYTEPS_ENABLE_ASYNC=1, docs/async.md): the servers keep the parameters.

At construction every worker push_pulls its parameters once (round 0 of each key: the servers keep
rank 0's values and return them to all). ``step()`` runs the wrapped optimizer locally, pushes each
parameter's delta ``new - old`` and continues from the servers' latest values, with no barrier."""
import contextlib

import torch

from byteps import common

from .ops import _start, synchronize


def _names_and_priorities(all_params, named_parameters):
    """``({id(p): name}, {id(p): priority})`` for the optimizer's parameters (unnamed: ``noname.<i>``).

    Priority by declaration order: parameters nearer the input are needed first by the next forward
    pass, so their tensors go first when the network is busy (P3 / ByteScheduler)."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        if any(not isinstance(item, tuple) for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        names = [n for n, _ in named_parameters]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"DistributedOptimizer: parameter names must be unique; repeated: {dups}")
        known = {id(p) for _, p in named_parameters}
        unnamed = [i for i, p in enumerate(all_params) if id(p) not in known]
        if unnamed:
            raise ValueError(f"DistributedOptimizer: named_parameters lacks {len(unnamed)} optimizer "
                             f"parameter(s) (positions {unnamed[:10]}); pass model.named_parameters()")
        names = {id(p): n for n, p in named_parameters}
    else:
        names = {id(p): f"noname.{i}" for i, p in enumerate(all_params)}
    return names, {id(p): -i for i, p in enumerate(all_params)}


class _AsyncDistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters):
        super(self.__class__, self).__init__(params)
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._names, self._priority = _names_and_priorities(all_params, named_parameters)
        self._old = {}          # param -> the values last pulled from the servers
        if not common.config().distributed:  # a lone process without servers: plain local training
            return
        with torch.no_grad():
            self._old = {p: p.detach().clone(memory_format=torch.contiguous_format) for p in all_params}
            self._exchange()  # every worker now holds rank 0's parameters

    def _exchange(self):
        """Push each parameter's ``old`` tensor and copy what the servers return into the parameter."""
        handles = [_start(old, "AsyncParameter." + self._names[id(p)], False, self._priority[id(p)],
                          asynchronous=True) for p, old in self._old.items()]
        for (p, old), handle in zip(self._old.items(), handles):
            synchronize(handle)
            p.copy_(old)

    def synchronize(self):
        """Nothing to wait for: asynchronous mode exchanges parameters in ``step()``."""

    def skip_synchronize(self):
        return contextlib.nullcontext()

    def step(self, closure=None):
        """Update locally, push each parameter's delta, and continue from the servers' latest values."""
        loss = super(self.__class__, self).step(closure)
        with torch.no_grad():
            for p, old in self._old.items():
                torch.sub(p.detach(), old, out=old)  # old now holds delta = new - old
            self._exchange()  # and then the latest parameters
        return loss


def AsyncDistributedOptimizer(optimizer, named_parameters=None):
    """Wrap ``optimizer`` for asynchronous training (requires BYTEPS_ENABLE_ASYNC=1 on every node).

    Constructing it exchanges the parameters once: every worker starts from rank 0's values.
    Use :func:`byteps.torch.DistributedOptimizer`, which returns this in asynchronous jobs.
    """
    if not common.config().enable_async:
        raise ValueError("asynchronous DistributedOptimizer needs BYTEPS_ENABLE_ASYNC=1 on every scheduler, "
                         "server and worker of the job (the servers must keep parameters instead of summing)")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_AsyncDistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters)
