"""Horovod's ``horovod.torch`` collectives on top of byteps' push_pull and broadcast.

A script written for Horovod runs unchanged with ``import byteps.torch as hvd``; docs/launchers.md
maps each collective onto the two primitives and gives its operations' names. A cross-rank mismatch
of shape, dtype or root raises :class:`byteps.TensorMismatchError` (a ``RuntimeError`` and a
:class:`HorovodInternalError`) on every rank; a name already in flight raises ``ValueError``.
"""
import contextlib
import threading
import warnings

import torch

from byteps import common
from byteps import errors
from byteps.common import mark_step, stop_timeline  # noqa: F401  (Horovod's stop_timeline; byteps' mark_step)
from byteps.errors import BytePSError
from byteps.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,  # noqa: F401
                               mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)

from . import completion
from .compression import Compression, wire_codec
from .ops import (_after_device_copies, _average_by, _broadcast_start, _buffers, _ready_again, _start,
                  _written_back, broadcast_async_ as _bps_broadcast_async_, dtype_code)
from .process_sets import (ProcessSet, _members, _wire_set, add_process_set, global_process_set,  # noqa: F401
                           remove_process_set)

Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

#: Horovod's error for a failed collective; byteps' errors are all of this type.
HorovodInternalError = BytePSError
UnsupportedTypeError = errors.UnsupportedTypeError  # a TypeError (byteps) and a ValueError (Horovod)

# ------------------------------------------------------------------------------ helpers

_busy = set()               # names of multi-stage operations in flight in this process
_busy_lock = threading.Lock()


def _name(prefix, name, pset=None):
    """The byteps name of an operation; unnamed ones are numbered per prefix, and per process set (whose
    members alone count its operations)."""
    if name is not None:
        return f"{prefix}.{name}"
    return common.auto_name(prefix, 0 if pset is None else pset[0])


def _code(tensor, name, move=False, pset=None, first_ops=None):
    """The tensor's wire dtype code (``move``: the operation only copies bytes, so int16 is fine too). A
    dtype byteps cannot move: this rank declares the operations the call would have started first
    (``first_ops``, default ``[name]``) abandoned, so that the ranks that make the call fail at once naming
    this one (common.abandon), then raises UnsupportedTypeError."""
    try:
        return dtype_code(tensor, name, move=move)
    except ValueError as e:
        for op_name in first_ops or [name]:
            common.abandon(op_name, pset, e)
        raise


def _in_flight(full):
    return ValueError(f"an operation named {full!r} is already in flight; synchronize it before starting "
                      "another one with the same name")


def _release(full):
    with _busy_lock:
        _busy.discard(full)


@contextlib.contextmanager
def _starting(full):
    """The start of a multi-stage operation named ``full``: reserves the name and yields the operation's
    Pending; an exception while its stages start releases the name, forgets the Pending and goes on
    to the caller."""
    with _busy_lock:
        if full in _busy:
            raise _in_flight(full)
        _busy.add(full)
    pending = None
    try:
        pending = completion.Pending(full)
        yield pending
    except BaseException:
        _release(full)
        if pending is not None:
            pending.discard()
        raise


def _when_finished(full, pending, handles, finish):
    """Once ``handles`` are done: release ``full``, then fail ``pending`` with the first error, or call
    ``finish(outcomes)`` (an exception there fails ``pending`` too)."""
    def done(outcomes):
        _release(full)
        err = completion.first_error(outcomes)
        if err is not None:
            pending.finish(error=err)
        else:
            finish(outcomes)

    completion.when_done(handles, pending.guard(done))


def _start_chain(full, starters, finish):
    """Reserve ``full``, start each thunk of ``starters`` (each returns a handle), and call
    ``finish(outcomes, pending)`` on the helper thread when all are done; returns the user's Pending.
    If a start fails after others, the Pending fails once those finish."""
    with _starting(full) as pending:
        handles = []
        try:
            for start in starters:
                handles.append(start())
        except BaseException as e:
            if handles:
                def fail(outcomes, err=e):
                    _release(full)
                    pending.finish(error=err)

                completion.when_done(handles, fail)
            raise
    _when_finished(full, pending, handles, lambda outcomes: finish(outcomes, pending))
    return pending


def _finish_with_results(outcomes, pending):
    """A grouped operation's end: the tuple of its parts' results."""
    pending.finish(result=tuple(r for r, _ in outcomes))


def _copies(tensors):
    return [_contiguous_copy(t) for t in tensors]


def _reset():
    """Forget in-flight names (at shutdown)."""
    with _busy_lock:
        _busy.clear()


def _check_inflight(full):
    job = common._require()
    with _busy_lock:
        busy = full in _busy
    if busy or full in job.inflight:
        raise _in_flight(full)


def _resolve_op(op, average):
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise NotImplementedError("byteps does not implement Adasum; use hvd.Average or hvd.Sum")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


def _scale_(t, factor):
    """Multiply in place by ``factor``: floats in their own precision (fp16/bf16 via fp32), integers via
    fp64 and truncation toward zero, as Horovod's ScaleBuffer does."""
    if factor == 1.0:
        return t
    with torch.no_grad():
        if t.dtype in (torch.float16, torch.bfloat16):
            t.copy_(t.float().mul_(factor))
        elif t.dtype.is_floating_point:
            t.mul_(factor)
        else:
            t.copy_(t.double().mul_(factor))
    return t


def _contiguous_copy(tensor):
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _grad_name(name):
    """The name of the operation that carries the gradient of the one named ``name``."""
    return None if name is None else f"{name}.grad"


def _allreduced(tensor, name, op, prescale_factor=1.0, postscale_factor=1.0, codec=None, pset=None):
    """A new tensor: ``tensor`` allreduced under the user's ``name``, waited for."""
    full = _name("allreduce", name, pset)
    return completion.synchronize(_allreduce_start(_contiguous_copy(tensor), full, op, prescale_factor,
                                                   postscale_factor, compression=codec, pset=pset))


# ------------------------------------------------------------------------------ allreduce

def _allreduce_start(tensor, full, op, prescale_factor=1.0, postscale_factor=1.0, priority=0, compression=None,
                     pset=None):
    """Start an in-place allreduce of ``tensor`` under the byteps name ``full`` among every rank or a
    process set's members (``pset``: None or ``(id, ranks)``); returns a handle."""
    if op in (Min, Max, Product):
        return _gather_reduce_start(tensor, full, op, prescale_factor, postscale_factor, pset)
    code = _code(tensor, full, pset=pset)
    _check_inflight(full)
    work, write_back, buf = _buffers(tensor)  # a CUDA tensor stays on the GPU: the core copies it per partition
    size = _members(pset)[0]
    if prescale_factor != 1.0:
        _scale_(work, prescale_factor)
        _ready_again(buf, work)
    average_by = _average_by(work, size, buf) if op == Average and postscale_factor == 1.0 else 1

    @torch.no_grad()
    def finalize():
        _after_device_copies(buf, work)
        if op == Average and size > 1 and average_by == 1:
            if work.dtype.is_floating_point:
                _scale_(work, postscale_factor)
                work.div_(size)
            elif postscale_factor == 1.0:  # exact integer division, truncated toward zero like Horovod
                work.copy_(torch.div(work, size, rounding_mode="trunc"))
            else:  # Horovod: postscale / size in fp64, truncated toward zero
                _scale_(work, postscale_factor / size)
        else:
            _scale_(work, postscale_factor)
        return _written_back(work, write_back)

    return common.submit(full, buf, code, tuple(tensor.shape), priority=priority, finalize=finalize,
                         compression=compression, process_set=pset, average_by=average_by)


_LOCAL_REDUCE = {Min: lambda s: s.amin(0), Max: lambda s: s.amax(0), Product: lambda s: s.prod(0, dtype=s.dtype)}


def _gather_reduce_start(tensor, full, op, prescale_factor, postscale_factor, pset=None):
    """Min/Max/Product: every rank broadcasts its tensor; each reduces the ``size`` tensors locally."""
    n, me, ranks = _members(pset)
    _code(tensor, full, pset=pset, first_ops=[f"{full}.{i}" for i in range(n)])
    src = _scale_(_contiguous_copy(tensor), prescale_factor)
    bufs = [src if i == me else torch.empty_like(src) for i in range(n)]

    def reduce(outcomes, pending):
        res = _scale_(_LOCAL_REDUCE[op](torch.stack(bufs)), postscale_factor)
        with torch.no_grad():
            tensor.copy_(res)
        pending.finish(result=tensor)

    starters = [lambda i=i: _broadcast_start(bufs[i], ranks[i], f"{full}.{i}", pset) for i in range(n)]
    return _start_chain(full, starters, reduce).handle


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Start an in-place allreduce of ``tensor``; returns a handle for :func:`poll` / :func:`synchronize`.

    ``op``: Average (default), Sum, Min, Max or Product. ``prescale_factor`` multiplies before the
    reduction, ``postscale_factor`` after (Average also divides by :func:`size`). Integer tensors
    are scaled in fp64 and truncated toward zero, as in Horovod.
    """
    pset = _wire_set(process_set)
    op = _resolve_op(op, average)
    return _allreduce_start(tensor, _name("allreduce", name, pset), op, prescale_factor, postscale_factor, pset=pset)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Out-of-place :func:`allreduce_async_`: ``synchronize`` returns a new tensor; the input is untouched."""
    return allreduce_async_(_contiguous_copy(tensor), None, name, _resolve_op(op, average), prescale_factor,
                            postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """In-place allreduce; returns ``tensor``."""
    return completion.synchronize(allreduce_async_(tensor, None, name, _resolve_op(op, average), prescale_factor,
                                                   postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, codec=None, pset=None):
        ctx.name, ctx.op, ctx.scale, ctx.codec, ctx.pset = name, op, (prescale_factor, postscale_factor), codec, pset
        return _allreduced(tensor, name, op, prescale_factor, postscale_factor, codec, pset)

    @staticmethod
    def backward(ctx, grad):
        out = _allreduced(grad, _grad_name(ctx.name), ctx.op, *ctx.scale, ctx.codec, ctx.pset)
        return out, None, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over every rank and return the result as a new tensor (differentiable).

    The gradient is allreduced with the same op (so the gradient of a Sum is ``size`` times the
    upstream gradient). ``compression`` is applied before and undone after.
    """
    pset = _wire_set(process_set)
    op = _resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    # a wire compressor (byteps.compression) is the identity on the tensor and travels to the engine
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, wire_codec(compression), pset)
    return compression.decompress(out, ctx)


# ------------------------------------------------------------------------------ grouped allreduce

def _grouped_start(tensors, name, op, prescale_factor, postscale_factor, pset=None):
    tensors = list(tensors)
    full = _name("grouped_allreduce", name, pset)
    # refused: the others' first operations for every tensor fail at once (Min/Max/Product: the broadcasts)
    firsts = [f"{full}.{j}" for j in range(len(tensors))]
    if op in (Min, Max, Product):
        firsts = [f"{f}.{r}" for f in firsts for r in range(_members(pset)[0])]
    for i, t in enumerate(tensors):
        _code(t, f"{full}.{i}", pset=pset, first_ops=firsts)
    starters = [lambda i=i, t=t: _allreduce_start(t, f"{full}.{i}", op, prescale_factor, postscale_factor, pset=pset)
                for i, t in enumerate(tensors)]
    return _start_chain(full, starters, _finish_with_results).handle


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    """In-place allreduce of every tensor of a list (position-wise); ``synchronize`` returns a tuple."""
    pset = _wire_set(process_set)
    op = _resolve_op(op, average)
    return _grouped_start(tensors, name, op, prescale_factor, postscale_factor, pset)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """Out-of-place :func:`grouped_allreduce_async_`."""
    return grouped_allreduce_async_(_copies(tensors), None, name, _resolve_op(op, average), prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return list(completion.synchronize(grouped_allreduce_async_(tensors, None, name, _resolve_op(op, average),
                                                                prescale_factor, postscale_factor, process_set)))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, pset, *tensors):
        ctx.name, ctx.op, ctx.scale, ctx.pset = name, op, (prescale_factor, postscale_factor), pset
        return completion.synchronize(_grouped_start(_copies(tensors), name, op, prescale_factor, postscale_factor,
                                                     pset))

    @staticmethod
    def backward(ctx, *grads):
        outs = completion.synchronize(_grouped_start(_copies(grads), _grad_name(ctx.name), ctx.op, *ctx.scale,
                                                     ctx.pset))
        return (None, None, None, None, None, *outs)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Allreduce every tensor of a list; returns a list of new tensors (differentiable)."""
    pset = _wire_set(process_set)
    op = _resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, pset, *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# ------------------------------------------------------------------------------ broadcast

def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Out-of-place broadcast: ``synchronize`` returns a new tensor; the input is never modified.

    Named like byteps' :func:`broadcast_async_` (the name as given; unnamed: ``broadcast.noname.<n>``).
    """
    return _bps_broadcast_async_(_contiguous_copy(tensor), root_rank, name, process_set=process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, pset):
        ctx.root_rank, ctx.name, ctx.pset = root_rank, name, pset
        return completion.synchronize(_broadcast_start(_contiguous_copy(tensor), root_rank, name, pset))

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduced(grad, _grad_name(ctx.name), Average, pset=ctx.pset)
        if common.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """A new tensor holding root_rank's ``tensor`` (differentiable: the gradient is averaged over ranks
    and kept on the root only). In a process set, ``root_rank`` is a member's global rank."""
    return _Broadcast.apply(tensor, root_rank, name, _wire_set(process_set))


# ------------------------------------------------------------------------------ allgather

def _allgather_start(tensor, name, pset=None):
    full = _name("allgather", name, pset)
    _code(tensor, full, move=True, pset=pset, first_ops=[f"{full}.sizes"])
    with _starting(full) as pending:
        n, me, ranks = _members(pset)
        src = _contiguous_copy(tensor)
        if src.dim() == 0:
            src = src.reshape(1)
        sizes = torch.zeros(n, dtype=torch.int64)
        sizes[me] = src.shape[0]
        first = _start(sizes, f"{full}.sizes", False, 0, pset=pset)

    def gather(outcomes):
        try:
            err = completion.first_error(outcomes)
            if err is not None:
                raise err
            counts = [int(c) for c in sizes.tolist()]
            pending.extra = counts
            out = torch.empty((sum(counts),) + tuple(src.shape[1:]), dtype=src.dtype)
            parts = list(out.split(counts))
            parts[me].copy_(src)
            handles = [_broadcast_start(parts[i], ranks[i], f"{full}.{i}", pset) for i in range(n) if counts[i] > 0]
        except Exception as e:  # the sizes' error, or (never for a consistent job) a refused broadcast
            _release(full)
            pending.finish(error=e)
            return
        _when_finished(full, pending, handles, lambda outs: pending.finish(result=out))

    completion.when_done([first], pending.guard(gather))
    return pending


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` along dim 0 (dim-0 sizes may differ); returns a handle."""
    return _allgather_start(tensor, name, _wire_set(process_set)).handle


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, pset):
        ctx.name, ctx.pset = name, pset
        pending = _allgather_start(tensor, name, pset)
        out = completion.synchronize(pending.handle)
        ctx.counts = pending.extra
        return out

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduced(grad, _grad_name(ctx.name), Average, pset=ctx.pset)
        me = _members(ctx.pset)[1]
        offset = sum(ctx.counts[:me])
        return reduced.narrow(0, offset, ctx.counts[me]), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along dim 0, in rank order (differentiable); in a process
    set, its members' tensors in the order of its ranks."""
    return _Allgather.apply(tensor, name, _wire_set(process_set))


# ------------------------------------------------------------------------------ join, barrier, misc

def join(device=-1):
    """This rank has no more data: wait until every rank has joined; return the last rank to join.

    As in Horovod, the other ranks' allreduces meanwhile complete with this rank contributing
    zeros (Average still divides by the full size), and broadcasts/allgathers raise on the ranks
    still running. ``device`` is accepted for compatibility.
    """
    return common.join()


def barrier(process_set=global_process_set):
    """Block until every rank (of ``process_set``) has called ``barrier()``."""
    pset = _wire_set(process_set)
    if pset is None:
        common.barrier()
        return
    completion.synchronize(_allreduce_start(torch.zeros(1), _name("barrier", None, pset), Sum, pset=pset))


def cross_rank():
    """This node's index among the nodes (byteps: DMLC_WORKER_ID)."""
    return common.config().worker_id


def cross_size():
    """Number of nodes (byteps: DMLC_NUM_WORKER)."""
    return common.config().num_worker


def is_homogeneous():
    return True


def start_timeline(file_path, mark_cycles=False):
    """Horovod's timeline on byteps's job timeline (docs/timeline.md): every worker, server and stage of
    the job from now on, in one Chrome/Perfetto trace at ``file_path``. ``mark_cycles`` is accepted
    and ignored (steps are marked by the optimizers and ``mark_step()``)."""
    common.start_timeline(file_path)

