"""Horovod's remaining torch collectives, built on mpi_ops' allgather and allreduce: alltoall, grouped
allgather and reducescatter, reducescatter (with autograd) and sparse allreduce. docs/launchers.md
says how each travels and what its operations are named. A name already in flight raises ``ValueError``.
"""
import torch

from byteps.errors import BytePSError
from byteps.splits import rows_sent, send_table, splits_row

from . import completion
from .compression import Compression
from .mpi_ops import (Average, Sum, _allgather_start, _allreduce_start, _code, _contiguous_copy, _copies,
                      _finish_with_results, _grad_name, _grouped_start, _members, _name, _start_chain, _wire_set,
                      global_process_set)


class ScalarInputError(BytePSError, ValueError):
    """A scalar where a collective needs dim 0 (Horovod raises ValueError, newer versions RuntimeError)."""



# ------------------------------------------------------------------------------ alltoall

def _given_splits(tensor, splits):
    """The splits as a list (None: equal blocks); the checks of their values are made on every rank alike
    (byteps/splits.py), after the alltoall's first gather."""
    if tensor.dim() == 0:
        raise ScalarInputError("alltoall does not support scalar inputs")
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall: splits must be an int32 tensor, got {splits.dtype}")
        return splits.reshape(-1).tolist()
    return [int(s) for s in splits]


def _alltoall_start(tensor, splits, name, pset=None):
    n, me, _ = _members(pset)
    rows = tensor.shape[0] if tensor.dim() else -1
    row = splits_row(rows, _given_splits(tensor, splits), n)
    full = _name("alltoall", name, pset)
    # its two allgathers' first operations (the splits' and the data's, started together)
    _code(tensor, full, move=True, pset=pset, first_ops=[f"allgather.{full}.{p}.sizes" for p in ("splits", "data")])
    # bad splits send no rows: the check after the first gather fails the alltoall on every rank
    src = _contiguous_copy(tensor.narrow(0, 0, rows_sent(row, n)))
    starters = [lambda: _allgather_start(torch.from_numpy(row.reshape(1, n + 2)), f"{full}.splits", pset).handle,
                lambda: _allgather_start(src, f"{full}.data", pset).handle]

    def finish(outcomes, pending):
        (table, _), (data, _) = outcomes
        matrix = send_table(full, table.numpy()).tolist()  # matrix[r][d]: rows rank r sends to rank d
        pieces, start = [], 0
        for r in range(n):
            offset = start + sum(matrix[r][:me])
            pieces.append(data.narrow(0, offset, matrix[r][me]))
            start += sum(matrix[r])
        out = torch.cat(pieces) if pieces else data[:0]
        received = torch.tensor([matrix[r][me] for r in range(n)], dtype=torch.int32)
        pending.finish(result=(out, received))

    return _start_chain(full, starters, finish)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)`` (int32), as Horovod's.

    ``splits[d]`` rows of dim 0 go to rank ``d``, in order (default: dim 0 split equally, which
    must then divide by :func:`size`); ``sum(splits)`` may be less than dim 0 (the rest is not
    sent). The output holds the rows every rank sent to this one, in source-rank order. In a
    process set, ranks are the set's members, indexed in the order of its ranks.
    """
    return _alltoall_start(tensor, splits, name, _wire_set(process_set)).handle


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, pset):
        out, received = completion.synchronize(_alltoall_start(tensor, splits, name, pset).handle)
        ctx.received, ctx.name, ctx.rows, ctx.pset = received, name, tensor.shape[0], pset
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *unused):
        g, _ = completion.synchronize(_alltoall_start(grad.contiguous(), ctx.received, _grad_name(ctx.name),
                                                      ctx.pset).handle)
        if g.shape[0] < ctx.rows:  # rows past sum(splits) were not sent: their gradient is zero
            g = torch.cat([g, g.new_zeros((ctx.rows - g.shape[0],) + tuple(g.shape[1:]))])
        return g, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter slices of dim 0 to every rank and gather the slices addressed to this one (differentiable:
    the gradient is the alltoall of the upstream gradient with the received splits).

    Returns the output, or ``(output, received_splits)`` when ``splits`` is given.
    """
    return _Alltoall.apply(tensor, splits, name, _wire_set(process_set))


# ------------------------------------------------------------------------------ grouped allgather

def _grouped_allgather_start(tensors, name, pset=None):
    tensors = list(tensors)
    full = _name("grouped_allgather", name, pset)
    for i, t in enumerate(tensors):
        _code(t, f"{full}.{i}", move=True, pset=pset,
              first_ops=[f"allgather.{full}.{j}.sizes" for j in range(len(tensors))])
    subs = []  # the allgathers' Pendings, in order

    def start(i, t):
        subs.append(_allgather_start(t, f"{full}.{i}", pset))
        return subs[-1].handle

    def finish(outcomes, pending):
        pending.extra = [p.extra for p in subs]  # dim-0 counts per tensor, per rank
        _finish_with_results(outcomes, pending)

    return _start_chain(full, [lambda i=i, t=t: start(i, t) for i, t in enumerate(tensors)], finish)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Allgather every tensor of a list; ``synchronize`` returns a tuple of the gathered tensors."""
    return _grouped_allgather_start(tensors, name, _wire_set(process_set)).handle


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, pset, *tensors):
        pending = _grouped_allgather_start(tensors, name, pset)
        outs = completion.synchronize(pending.handle)
        ctx.counts, ctx.name, ctx.pset = pending.extra, name, pset
        return outs

    @staticmethod
    def backward(ctx, *grads):
        reduced = completion.synchronize(_grouped_start(_copies(grads), _grad_name(ctx.name), Average, 1.0, 1.0,
                                                        ctx.pset))
        me = _members(ctx.pset)[1]
        return (None, None, *[r.narrow(0, sum(c[:me]), c[me]) for r, c in zip(reduced, ctx.counts)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather every tensor of a list; returns a list (differentiable, like :func:`allgather`)."""
    return list(_GroupedAllgather.apply(name, _wire_set(process_set), *tensors))


# ------------------------------------------------------------------------------ reducescatter

def _check_reducescatter(tensor, op):
    if op not in (Average, Sum):
        raise RuntimeError("Reducescatter currently only supports AVERAGE and SUM.")
    if tensor.dim() == 0:
        raise ScalarInputError("Reducescatter does not support scalar inputs")


def _reducescatter_grads(ctx, grads):
    """A reducescatter's gradient: the upstream gradients gathered (Horovod: times size for a Sum)."""
    if ctx.op == Sum:
        return [g * _members(ctx.pset)[0] for g in grads]
    return grads


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks, then keep this rank's block of dim 0 (the first
    ``dim0 % size`` ranks get one extra row, as in Horovod). Average and Sum only."""
    pset = _wire_set(process_set)
    _check_reducescatter(tensor, op)
    full = _name("reducescatter", name, pset)
    n, me, _ = _members(pset)
    rows = tensor.shape[0]
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]

    def cut(outcomes, pending):
        (res, _), = outcomes
        pending.finish(result=res.narrow(0, sum(counts[:me]), counts[me]).clone())

    def start():
        return _allreduce_start(_contiguous_copy(tensor), full + ".sum", op, prescale_factor, postscale_factor,
                                pset=pset)

    return _start_chain(full, [start], cut).handle


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op, ctx.name, ctx.pset = op, name, _wire_set(process_set)
        return completion.synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                                          postscale_factor))

    @staticmethod
    def backward(ctx, grad):
        g = completion.synchronize(_allgather_start(_contiguous_copy(grad), _grad_name(ctx.name), ctx.pset).handle)
        return _reducescatter_grads(ctx, [g])[0], None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over every rank and return this rank's block of dim 0 (the first ``dim0 %
    size`` ranks get one extra row). Differentiable: the gradient is the upstream gradient gathered
    from every rank (times ``size`` for Sum), as in Horovod."""
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, cctx)


def _grouped_reducescatter_start(tensors, name, op, prescale_factor, postscale_factor,
                                 process_set=global_process_set):
    pset = _wire_set(process_set)
    tensors = list(tensors)
    for t in tensors:
        _check_reducescatter(t, op)
    full = _name("grouped_reducescatter", name, pset)  # after the checks: a refused call takes no number
    starters = [lambda i=i, t=t: reducescatter_async(t, f"{full}.{i}", op, process_set, prescale_factor,
                                                      postscale_factor)
                for i, t in enumerate(tensors)]
    return _start_chain(full, starters, _finish_with_results)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter every tensor of a list; ``synchronize`` returns a tuple."""
    return _grouped_reducescatter_start(tensors, name, op, prescale_factor, postscale_factor, process_set).handle


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.op, ctx.name, ctx.pset = op, name, _wire_set(process_set)
        return completion.synchronize(_grouped_reducescatter_start(tensors, name, op, prescale_factor,
                                                                   postscale_factor, process_set).handle)

    @staticmethod
    def backward(ctx, *grads):
        gathered = completion.synchronize(_grouped_allgather_start(_copies(grads), _grad_name(ctx.name),
                                                                   ctx.pset).handle)
        return (None, None, None, None, None, *_reducescatter_grads(ctx, gathered))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter every tensor of a list; returns a list (differentiable, like :func:`reducescatter`)."""
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, process_set,
                                       *[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# ------------------------------------------------------------------------------ sparse allreduce

def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Horovod's sparse allreduce of a COO tensor: its indices and values are allgathered, and the
    returned callable waits and builds the (uncoalesced) sum; Average divides the values by ``size``."""
    pset = _wire_set(process_set)
    indices = _allgather_start(tensor._indices().transpose(0, 1).contiguous(), f"{name}.indices", pset)
    values = _allgather_start(tensor._values().contiguous(), f"{name}.values", pset)
    n = _members(pset)[0]

    def handle():
        vals = completion.synchronize(values.handle)
        idx = completion.synchronize(indices.handle)
        if op == Average:
            vals = vals / n
        if idx.dim() == 0 or vals.dim() == 0:
            return tensor.new().resize_as_(tensor)
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, tensor.size())

    return handle
