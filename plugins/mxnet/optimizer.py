"""DistributedOptimizer (wraps an ``mx.optimizer.Optimizer``) and DistributedTrainer (a Gluon Trainer)."""
import mxnet as mx

from byteps import common

from .compression import from_params
from .ops import _start, _synchronize_copies, broadcast_async_, push_pull_async, synchronize


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wrap ``optimizer`` so that every gradient is averaged over all workers before its update.

    ``update``/``update_multi_precision`` push_pull the gradient (tensor name ``gradient_<index>``,
    priority ``-index``) and then call the wrapped optimizer; aggregated updates (``index`` a list)
    send every gradient before waiting for the first. Every other attribute, read or written, is the
    wrapped optimizer's (docs/mxnet.md). Call :func:`broadcast_parameters` first.
    """

    def __init__(self, optimizer, compression=None):  # pylint: disable=super-init-not-called
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps an mx.optimizer.Optimizer, not {type(optimizer).__name__}")
        # No Optimizer.__init__: all state lives in the wrapped optimizer.
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_bps_compression"] = compression  # a wire compressor (docs/compression.md) or None

    def __getattr__(self, item):
        if item == "_optimizer":  # during unpickling, before __setstate__
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, key, value):
        setattr(self._optimizer, key, value)

    def __getstate__(self):
        return {"_optimizer": self._optimizer}

    def __setstate__(self, state):
        self.__dict__["_optimizer"] = state["_optimizer"]

    def _do_push_pull(self, index, grad):
        if common.size() == 1:
            return
        comp = self.__dict__.get("_bps_compression")
        if not isinstance(index, (tuple, list)):
            index, grad = [index], [grad]
        handles = [push_pull_async(g, average=True, name=f"gradient_{i}", priority=-i, compression=comp)
                   for i, g in zip(index, grad)]
        for h in handles:
            synchronize(h)

    def update(self, index, weight, grad, state):
        self._do_push_pull(index, grad)
        return self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._do_push_pull(index, grad)
        return self._optimizer.update_multi_precision(index, weight, grad, state)

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate


def _delegate(name):
    def method(self, *args, **kwargs):
        return getattr(self._optimizer, name)(*args, **kwargs)

    method.__name__ = name
    return method


# Optimizer's own methods would run on the wrapper and bypass the wrapped class's overrides.
for _method in ("create_state", "create_state_multi_precision", "set_learning_rate", "set_lr_scale", "set_lr_mult",
                "set_wd_mult", "_set_current_context", "_update_count", "_get_lrs", "_get_lr", "_get_wds", "_get_wd"):
    setattr(DistributedOptimizer, _method, _delegate(_method))


def _unique_names(params):
    """Parameter names, with ``#k`` appended to the k-th repeat of a name (a list may repeat one)."""
    seen, out = {}, []
    for p in params:
        k = seen.get(p.name, 0)
        seen[p.name] = k + 1
        out.append(p.name if k == 0 else f"{p.name}#{k}")
    return out


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` (``kvstore=None``) whose gradients are summed over all workers by the Summation
    Service; docs/mxnet.md describes it.

    Parameters are ordered by name, so every worker sends the same tensors under the same names
    (``Parameter.<name>``, ``Gradient.<name>``); initialized ones are broadcast from ``root_rank`` at
    construction, deferred-initialized ones at the first ``step()``. ``step()`` starts every
    gradient's push_pull before it waits for the first; the average comes from ``rescale_grad``,
    divided by :func:`size`. Several contexts per worker are summed locally first.

    Args:
        params: a ``ParameterDict`` (``net.collect_params()``), a dict of Parameters or a list.
        optimizer: an optimizer name or an ``mx.optimizer.Optimizer`` (not a DistributedOptimizer).
        optimizer_params: keyword arguments for a named optimizer.
        root_rank: the rank whose initial parameters every worker receives.
        compression_params: BytePS's gradient compression dict, e.g. ``{"compressor": "onebit",
            "ef": "vanilla"}`` (byteps.compression.from_params; docs/compression.md).

    With ``BYTEPS_ENABLE_ASYNC=1`` it trains asynchronously (docs/async.md): ``step()`` updates from
    this worker's gradients, pushes each parameter's delta and continues from the servers' values.
    """

    def __init__(self, params, optimizer, optimizer_params=None, root_rank=0, compression_params=None):
        codec = from_params(compression_params)  # ValueError naming a bad key before anything starts
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("DistributedTrainer already sums gradients; pass the plain optimizer, "
                            "not a DistributedOptimizer (that would reduce every gradient twice)")
        if isinstance(params, (dict, mx.gluon.ParameterDict)):
            params = [params[k] for k in sorted(params.keys())]
        elif isinstance(params, (list, tuple)):
            params = sorted(params, key=lambda p: getattr(p, "name", ""))
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._bps_size = common.size()
        self._bps_codec = codec
        self._bps_async = common.config().enable_async and common.config().distributed
        self._bps_pulled = {}  # asynchronous mode: parameter -> values last pulled from the servers
        if not self._bps_async:
            # Trainer.step() sets rescale_grad = _scale / batch_size: dividing by size() turns the
            # push_pull sum into the average over every worker's batch.
            self._scale /= self._bps_size
        self._root_rank = root_rank
        self._bps_names = {id(p): n for p, n in zip(self._params, _unique_names(self._params))}
        self._init_params()

    def _init_params(self):
        """Broadcast every initialized parameter from root_rank; keep deferred ones for later."""
        deferred, pending = [], []
        for param in self._params_to_init:
            if param._deferred_init:
                deferred.append(param)
                continue
            arrays = param.list_data()
            if self._bps_async:  # round 0 of the parameter's asynchronous key: rank 0's values win
                pulled = arrays[0].copy()
                self._bps_pulled[id(param)] = pulled
                pending.append((self._async_start(param, pulled), [pulled, *arrays]))
            elif self._bps_size > 1:
                handle = broadcast_async_(arrays[0], self._root_rank, name="Parameter." + self._bps_names[id(param)])
                pending.append((handle, arrays))
        _synchronize_copies(pending)
        self._params_to_init = deferred

    def _async_start(self, param, array):
        return _start(array, "AsyncParameter." + self._bps_names[id(param)], False, 0, asynchronous=True)

    def _update(self, ignore_stale_grad=False):
        super()._update(ignore_stale_grad)
        if not self._bps_async:
            return
        pending = []
        for param in self._params:
            pulled = self._bps_pulled.get(id(param))
            if pulled is None or param.grad_req == "null":
                continue
            arrays = param.list_data()
            pulled[:] = arrays[0] - pulled          # the delta of this step
            pending.append((self._async_start(param, pulled), [pulled, *arrays]))
        _synchronize_copies(pending)  # continue from the servers' latest parameters

    def _allreduce_grads(self):
        pending = []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            if grads[0].stype != "default" and not self._bps_async:
                raise TypeError(f"byteps.mxnet.DistributedTrainer: parameter {param.name!r} has a "
                                f"{grads[0].stype} gradient; only dense gradients are supported")
            for other in grads[1:]:  # several contexts on this worker: sum them locally first
                grads[0] += other.as_in_context(grads[0].context)
            handle = None
            # asynchronous mode: each worker updates from its own gradients; deltas go out in _update
            if self._bps_size > 1 and not self._bps_async:
                handle = push_pull_async(grads[0], average=False, name="Gradient." + self._bps_names[id(param)],
                                         priority=-i, compression=self._bps_codec)
            pending.append((handle, grads))
        _synchronize_copies(pending)
