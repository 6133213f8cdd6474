"""DistributedOptimizer (wraps an ``mx.optimizer.Optimizer``) and DistributedTrainer (a Gluon Trainer)."""
import mxnet as mx

from byteps import common

from .compression import from_params
from .ops import _start, broadcast_async_, push_pull_async, synchronize


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wrap ``optimizer`` so that every gradient is averaged over all workers before its update.

    ``update``/``update_multi_precision`` push_pull the gradient (tensor name ``gradient_<index>``,
    priority ``-index``, average) and then call the wrapped optimizer. With aggregated updates
    (``index`` a list, as MXNet's SGD does by default) all the gradients are sent before the first
    is waited for. Every other attribute, read or written, is the wrapped optimizer's, so a
    ``gluon.Trainer(params, DistributedOptimizer(opt), kvstore=None)`` sets the wrapped optimizer's
    ``param_dict`` and ``rescale_grad``. Parameters are not broadcast: call
    :func:`broadcast_parameters` first (or use :class:`DistributedTrainer`).
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
        if isinstance(index, (tuple, list)):
            handles = [push_pull_async(g, average=True, name=f"gradient_{i}", priority=-i, compression=comp)
                       for i, g in zip(index, grad)]
        else:
            handles = [push_pull_async(grad, average=True, name=f"gradient_{index}", priority=-index,
                                       compression=comp)]
        for h in handles:
            synchronize(h)

    def update(self, index, weight, grad, state):
        self._do_push_pull(index, grad)
        return self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._do_push_pull(index, grad)
        return self._optimizer.update_multi_precision(index, weight, grad, state)

    # Optimizer's own methods would run on the wrapper and bypass the wrapped class's overrides.
    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    def set_learning_rate(self, lr):
        return self._optimizer.set_learning_rate(lr)

    def set_lr_scale(self, args_lrscale):
        return self._optimizer.set_lr_scale(args_lrscale)

    def set_lr_mult(self, args_lr_mult):
        return self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        return self._optimizer.set_wd_mult(args_wd_mult)

    def _set_current_context(self, device_id):
        return self._optimizer._set_current_context(device_id)

    def _update_count(self, index):
        return self._optimizer._update_count(index)

    def _get_lrs(self, indices):
        return self._optimizer._get_lrs(indices)

    def _get_lr(self, index):
        return self._optimizer._get_lr(index)

    def _get_wds(self, indices):
        return self._optimizer._get_wds(indices)

    def _get_wd(self, index):
        return self._optimizer._get_wd(index)


def _unique_names(params):
    """Parameter names, with ``#k`` appended to the k-th repeat of a name (a list may repeat one)."""
    seen, out = {}, []
    for p in params:
        k = seen.get(p.name, 0)
        seen[p.name] = k + 1
        out.append(p.name if k == 0 else f"{p.name}#{k}")
    return out


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose gradients are summed over all workers by the Summation Service.

    Created with ``kvstore=None``. Parameters are ordered by name, so every worker sends the same
    tensors under the same names (``Parameter.<name>``, ``Gradient.<name>``) even if it listed them
    in another order. Parameters that are already initialized are broadcast from ``root_rank``
    when the trainer is created; deferred-initialized ones at the first ``step()`` (after the first
    forward pass has given them a shape). ``step()`` starts every gradient's push_pull (a sum,
    priority ``-index``) before it waits for the first, and the average comes from the optimizer's
    ``rescale_grad``, divided by :func:`size` (as BytePS does). Several contexts per worker are
    summed locally first.

    Args:
        params: a ``ParameterDict`` (``net.collect_params()``), a dict of Parameters or a list.
        optimizer: an optimizer name or an ``mx.optimizer.Optimizer`` (not a DistributedOptimizer).
        optimizer_params: keyword arguments for a named optimizer.
        root_rank: the rank whose initial parameters every worker receives.
        compression_params: BytePS's gradient compression, a dict such as ``{"compressor": "onebit",
            "ef": "vanilla"}`` (keys: byteps.compression.from_params; docs/compression.md); applied
            to every gradient on the wire.

    With ``BYTEPS_ENABLE_ASYNC=1`` the trainer trains asynchronously (docs/async.md): parameters
    start from rank 0's (kept by the servers), ``step()`` updates locally from this worker's own
    gradients, pushes each parameter's delta and continues from the servers' latest values.
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
        for handle, arrays in pending:
            synchronize(handle)
            for other in arrays[1:]:
                arrays[0].copyto(other)
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
        for handle, arrays in pending:               # continue from the servers' latest parameters
            synchronize(handle)
            for other in arrays[1:]:
                arrays[0].copyto(other)

    def _allreduce_grads(self):
        if self._bps_async:  # each worker updates from its own gradients; deltas go out in _update
            for param in self._params:
                grads = param.list_grad() if param.grad_req != "null" else []
                for other in grads[1:]:
                    grads[0] += other.as_in_context(grads[0].context)
                for other in grads[1:]:
                    grads[0].copyto(other)
            return
        pending = []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            if grads[0].stype != "default":
                raise TypeError(f"byteps.mxnet.DistributedTrainer: parameter {param.name!r} has a "
                                f"{grads[0].stype} gradient; only dense gradients are supported")
            for other in grads[1:]:  # several contexts on this worker: sum them locally first
                grads[0] += other.as_in_context(grads[0].context)
            if self._bps_size > 1:
                handle = push_pull_async(grads[0], average=False, name="Gradient." + self._bps_names[id(param)],
                                         priority=-i, compression=self._bps_codec)
                pending.append((handle, grads))
            else:
                pending.append((None, grads))
        for handle, grads in pending:
            if handle is not None:
                synchronize(handle)
            for other in grads[1:]:
                grads[0].copyto(other)
