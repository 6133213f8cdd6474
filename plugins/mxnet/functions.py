"""broadcast_parameters for MXNet: Module API dicts of NDArrays and Gluon parameters."""
import mxnet as mx

from .ops import _synchronize_copies, broadcast_async_


def _arrays(name, value):
    """The NDArrays behind one entry: an NDArray, or every context's copy of a Gluon Parameter."""
    if isinstance(value, mx.gluon.Parameter):
        if value._deferred_init:
            raise ValueError(f"byteps.mxnet.broadcast_parameters: parameter {name!r} is not initialized yet "
                             "(deferred initialization: its shape is known only after the first forward pass); "
                             "give the layer its input size, run one forward pass first, or let "
                             "DistributedTrainer broadcast it at its first step()")
        return value.list_data()
    if isinstance(value, mx.nd.NDArray):
        return [value]
    raise TypeError(f"byteps.mxnet.broadcast_parameters: {name!r} is a {type(value).__name__}, "
                    "not an NDArray or a gluon Parameter")


def broadcast_parameters(params, root_rank=0, prefix="Parameter."):
    """Overwrite every array in ``params`` with root_rank's values, in place.

    A real broadcast: non-root values (NaN included) are never mixed into the result.

    Args:
        params: a dict of name -> NDArray (``arg_params``/``aux_params`` of the Module API), a Gluon
            ``ParameterDict`` (``net.collect_params()``) or dict of Parameters, or a list of
            Parameters (named by ``Parameter.name``). Entries are broadcast in sorted-name order
            under the tensor name ``prefix + name``, so every worker must pass the same names.
        root_rank: the rank whose values every worker receives.
        prefix: prepended to each name to form the tensor name.
    """
    if isinstance(params, (dict, mx.gluon.ParameterDict)):
        items = [(k, params[k]) for k in sorted(params.keys())]
    else:
        items = []
        for i, p in enumerate(params):
            if not isinstance(p, (mx.gluon.Parameter, tuple)):
                raise TypeError("byteps.mxnet.broadcast_parameters: a list must hold gluon Parameters or "
                                f"(name, array) pairs; item {i} is a {type(p).__name__}")
            items.append(p if isinstance(p, tuple) else (p.name, p))
        items.sort(key=lambda kv: kv[0])
    names = [k for k, _ in items]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"byteps.mxnet.broadcast_parameters: parameter names must be unique; repeated: {dups}")
    pending = []
    for name, value in items:
        if value is None:
            continue
        arrays = _arrays(name, value)
        pending.append((broadcast_async_(arrays[0], root_rank, name=prefix + name), arrays))
    _synchronize_copies(pending)
