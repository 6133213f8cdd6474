"""Broadcast helpers: parameters, optimizer state, arbitrary picklable objects."""
import collections
import pickle

import torch

from byteps import common

from .ops import broadcast_async_, synchronize


def _named_tensors(params):
    if isinstance(params, dict):
        return sorted(params.items())
    items = list(params)
    if items and isinstance(items[0], tuple):
        return items
    return [(f"param.{i}", p) for i, p in enumerate(items)]


def _broadcast_all(named, root_rank):
    """Broadcast every ``(name, tensor)`` in place: all are started before the first is waited for."""
    for handle in [broadcast_async_(t, root_rank, name=n) for n, t in named]:
        synchronize(handle)


def broadcast_parameters(params, root_rank, prefix="Parameter."):
    """Overwrite every tensor in ``params`` with root_rank's values (in place).

    Args:
        params: a ``state_dict()``, ``named_parameters()``, or a list of tensors.
        root_rank: the rank whose values every worker receives.
        prefix: prepended to each name to form the broadcast's tensor name.
    """
    _broadcast_all([(prefix + name, p.data if isinstance(p, torch.nn.Parameter) else p)
                    for name, p in _named_tensors(params) if p is not None], root_rank)


_object_counter = collections.Counter()  # process set id -> unnamed object collectives so far


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Return root_rank's ``obj`` on every worker (pickled on the root, unpickled elsewhere).

    Only authenticated job members can take part (docs/architecture.md); never use it with a
    root you do not trust, since unpickling runs code. In a ``process_set``, only its members call it.
    """
    if name is None:
        name = _object_name("broadcast_object", process_set)
    if common.rank() == root_rank:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    synchronize(broadcast_async_(length, root_rank, name=f"{name}.size", process_set=process_set))
    if common.rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    synchronize(broadcast_async_(payload, root_rank, name=f"{name}.data", process_set=process_set))
    if common.rank() == root_rank:
        return obj
    return pickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name=None, process_set=None):
    """A list with every rank's ``obj``, in rank order (one broadcast per rank; in a ``process_set``,
    its members' objects in the order of its ranks)."""
    base = name or _object_name("allgather_object", process_set)
    ranks = list(range(common.size())) if process_set is None else process_set.ranks
    return [broadcast_object(obj, root, name=f"{base}.{root}", process_set=process_set) for root in ranks]


def _object_name(prefix, process_set):
    """Unnamed object collectives are numbered per process set: only its members count them."""
    pid = getattr(process_set, "process_set_id", 0) or 0
    n = _object_counter[pid]
    _object_counter[pid] += 1
    return f"{prefix}.{n}" if not pid else f"{prefix}.set{pid}.{n}"


def broadcast_optimizer_state(optimizer, root_rank, prefix="Parameter.", model=None):
    """Make every worker's optimizer state (tensors, scalars, hyper-parameters) equal root_rank's.

    As in Horovod, an optimizer whose state is still empty first takes one local step with zero
    gradients (the wrapped optimizer's own step for a :func:`DistributedOptimizer`, so nothing is
    reduced), which creates its state and leaves every trainable parameter a zero ``.grad``
    (sparse for ``SparseAdam``, and for ``model``'s sparse embeddings). Then the root's state
    layout is broadcast as an object, tensors travel as real broadcasts, and each worker loads the
    result with ``load_state_dict``, so a worker's state may differ in layout from the root's.
    Unlike Horovod, ``LBFGS`` works too (without the dummy step, which would need a closure).
    """
    state = optimizer.state_dict()
    if not state["state"] and not isinstance(optimizer, torch.optim.LBFGS):  # LBFGS' step needs a closure
        _initialize_state(optimizer, model)
        state = optimizer.state_dict()
    layout = None
    if common.rank() == root_rank:
        layout = _describe(state)
    layout = broadcast_object(layout, root_rank, name=f"{prefix}optimizer.layout")
    tensors = []
    rebuilt = _rebuild(layout, state if common.rank() == root_rank else None, tensors)
    _broadcast_all([(f"{prefix}optimizer.{i}", t) for i, t in enumerate(tensors)], root_rank)
    if common.rank() != root_rank:
        optimizer.load_state_dict(rebuilt)


def _initialize_state(optimizer, model=None):
    """Horovod's state initialisation: zero gradients, then one local (never reduced) step."""
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = p.data.new(p.size()).zero_()
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
    from .optimizer import _DistributedOptimizer

    if type(optimizer).__module__ == _DistributedOptimizer.__module__:
        super(optimizer.__class__, optimizer).step()  # the wrapped class's step: no push_pull
    else:
        optimizer.step()


def _describe(obj):
    """The state dict with each tensor replaced by its (shape, dtype) so it can travel as an object."""
    if isinstance(obj, torch.Tensor):
        return ("__tensor__", tuple(obj.shape), str(obj.dtype).split(".")[-1])
    if isinstance(obj, dict):
        return {k: _describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_describe(v) for v in obj)
    return obj


def _rebuild(layout, local, tensors):
    """Rebuild the state from ``layout``: the root reuses its own tensors, others allocate them."""
    if isinstance(layout, tuple) and len(layout) == 3 and layout[0] == "__tensor__":
        t = local.detach().clone().contiguous() if local is not None else \
            torch.empty(layout[1], dtype=getattr(torch, layout[2]))
        tensors.append(t)
        return t
    if isinstance(layout, dict):
        return {k: _rebuild(v, None if local is None else local[k], tensors) for k, v in layout.items()}
    if isinstance(layout, (list, tuple)):
        return type(layout)(_rebuild(v, None if local is None else local[i], tensors) for i, v in enumerate(layout))
    return layout
