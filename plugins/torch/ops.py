"""push_pull and broadcast on torch tensors, CPU and CUDA.

A contiguous CPU tensor reaches the core as a uint8 view of its own memory (else a contiguous copy,
written back at synchronize). A CUDA tensor reaches it as its device memory (core/device_buffer.py)
with a ready event on the caller's current stream: the core copies it off the GPU and back partition
by partition, and ``synchronize`` makes the current stream wait for the op's done event.
"""
import torch

from byteps import common
from byteps.buffers import MIN_POOLED_BYTES, pool
from byteps.core import dtypes
from byteps.core._reduce import byte_array
from byteps.core.device_buffer import DeviceBuffer
from byteps.errors import UnsupportedTypeError

from .completion import poll, synchronize
from .compression import Compression, wire_codec
from .process_sets import _wire_set

__all__ = ["push_pull", "push_pull_async", "push_pull_async_inplace", "push_pull_inplace", "broadcast_",
           "broadcast_async_", "poll", "synchronize", "declare"]

_TORCH_DTYPES = {torch.float32: dtypes.FLOAT32, torch.float64: dtypes.FLOAT64, torch.float16: dtypes.FLOAT16,
                 torch.bfloat16: dtypes.BFLOAT16, torch.int32: dtypes.INT32, torch.int64: dtypes.INT64,
                 torch.uint8: dtypes.UINT8, torch.int8: dtypes.INT8}


#: dtypes byteps only moves (broadcast, allgather, alltoall: Horovod's int16), never sums: they
#: travel as uint8 with the element's bytes as an extra last dimension, so shapes still compare
_MOVE_ONLY = (torch.int16,)


def dtype_code(tensor, name, move=False):
    """The wire dtype code of ``tensor``; ``move``: the operation only copies bytes (broadcast), so
    int16 is accepted too (as uint8). UnsupportedTypeError (a TypeError and a ValueError) otherwise."""
    try:
        return _TORCH_DTYPES[tensor.dtype]
    except KeyError:
        if move and tensor.dtype in _MOVE_ONLY:
            return dtypes.UINT8
        supported = ", ".join(str(d) for d in _TORCH_DTYPES)
        moved = ", ".join(str(d) for d in _MOVE_ONLY)
        raise UnsupportedTypeError(f"byteps: tensor {name!r} has unsupported dtype {tensor.dtype}; supported: "
                                   f"{supported} (and {moved} for broadcast, allgather and alltoall)") from None


def _buffers(tensor):
    """(work tensor, write_back, buffer for common.submit). ``work`` is ``tensor`` when it is contiguous
    (and in host memory or on a GPU), else a contiguous copy that finalize writes back into
    ``write_back``; the buffer is a flat uint8 view of host memory, or a CUDA tensor's DeviceBuffer."""
    if tensor.is_cuda:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        return work, None if work is tensor else tensor, _native_device_buffer(work)
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        work, write_back = tensor, None
    else:
        work, write_back = tensor.detach().to("cpu", copy=True).contiguous(), tensor
    return work, write_back, byte_array(work.data_ptr(), work.numel() * work.element_size(), work)


def _native_device_buffer(work):
    """The DeviceBuffer of contiguous CUDA tensor ``work``: its device memory, a ready event recorded now on
    the caller's current stream (the first copy waits for it on the GPU, the host does not) and a done
    event the core records after the op's last copy. It keeps ``work`` and both events alive."""
    stream = torch.cuda.current_stream(work.device)
    ready, done = torch.cuda.Event(), torch.cuda.Event()
    ready.record(stream)
    done.record(stream)  # torch creates an event at its first record: the core records it again, later
    return DeviceBuffer(work.data_ptr(), work.numel() * work.element_size(), work.device.index, ready.cuda_event,
                        done.cuda_event, keep=(work, ready, done))


def _ready_again(buf, work):
    """Work queued on CUDA tensor ``work`` after :func:`_buffers` (a prescale) must come before the copies
    too: its ready event recorded again, now (the core waits for the latest record at its first copy)."""
    if isinstance(buf, DeviceBuffer):
        buf.keep[1].record(torch.cuda.current_stream(work.device))


def _after_device_copies(buf, work):
    """At synchronize: the caller's current stream waits for the op's done event (no host block)."""
    if isinstance(buf, DeviceBuffer):
        torch.cuda.current_stream(work.device).wait_event(buf.keep[2])


def _average_by(work, size, buf=None):
    """common.submit's ``average_by`` for an average of ``work`` over ``size`` workers: ``size`` for a float
    tensor in host memory or in a DeviceBuffer (divided as it is copied in); else 1 (the caller divides)."""
    native = work.device.type == "cpu" or isinstance(buf, DeviceBuffer)
    return size if size > 1 and work.is_floating_point() and native else 1


def _divide_(work, size):
    """An average's division, in place: floor division for an integer tensor (docs/architecture.md)."""
    return work.div_(size) if work.dtype.is_floating_point else work.floor_divide_(size)


def _written_back(work, write_back):
    """An operation's result: ``work``, copied into the caller's tensor when ``work`` is a copy of it."""
    return work if write_back is None else write_back.copy_(work)


def _start(tensor, name, average, priority, root=None, asynchronous=False, compression=None, sync=False, pset=None):
    """Submit ``tensor`` in place: a push_pull, or a broadcast from ``root`` (``sync``: the caller
    synchronizes it at once; common.submit); ``pset``: None (every rank) or a process set's ``(id, ranks)``."""
    if name is None:  # numbered per prefix, and per process set (whose members alone count its operations)
        name = common.auto_name("push_pull" if root is None else "broadcast", 0 if pset is None else pset[0])
    try:
        code = dtype_code(tensor, name, move=root is not None)
        work, write_back, buf = _buffers(tensor)
    except ValueError as e:  # refused here: the other ranks must not wait for our declaration
        common.abandon(name, pset, e)
        raise
    size = common.size() if pset is None else len(pset[1])
    average_by = _average_by(work, size, buf) if average else 1  # (a broadcast or async push never averages)

    def finalize():
        _after_device_copies(buf, work)
        if average and size > 1 and average_by == 1:
            _divide_(work, size)
        return _written_back(work, write_back)

    shape = (*tensor.shape, tensor.element_size()) if tensor.dtype in _MOVE_ONLY else tuple(tensor.shape)
    return common.submit(name, buf, code, shape, broadcast_root=root, priority=priority,
                         finalize=finalize, asynchronous=asynchronous, compression=_wire(compression), sync=sync,
                         process_set=pset, average_by=average_by)


def _broadcast_start(tensor, root_rank, name, pset=None):
    """In-place broadcast among every rank or a process set's members (``pset``: see :func:`_start`)."""
    return _start(tensor, name, False, 0, root=root_rank, pset=pset)


def push_pull_async_inplace(tensor, average=True, name=None, version=0, priority=0, compression=None):
    """Start summing ``tensor`` over all workers, in place; returns a handle.

    Args:
        tensor: the tensor; its contents are replaced by the sum (or average).
        average: divide by :func:`size` (floor division for integer tensors).
        name: a name unique among in-flight operations, the same on every worker. Unnamed calls
            get ``push_pull.noname.<n>``, numbered in call order.
        version: accepted for BytePS compatibility; unused.
        priority: larger runs earlier when the pipeline has a choice.
        compression: a wire compressor (``Compression.onebit(...)``, ...) for the partitions that
            cross the network; None: the job's default (BYTEPS_COMPRESSOR); False: none.
    """
    return _start(tensor, name, average, priority, compression=compression)


def _wire(compression):
    """What common.submit takes: a wire codec, None (the job's default) or False."""
    return compression if compression is None or compression is False else wire_codec(compression)


def push_pull_async(tensor, average=True, name=None, version=0, priority=0, compression=None):
    """Out-of-place :func:`push_pull_async_inplace`: ``synchronize`` returns a new tensor."""
    return _start(out_of_place(tensor), name, average, priority, compression=compression)


def out_of_place(tensor):
    """A contiguous copy of ``tensor`` to push_pull into and return. A large CPU tensor's copy goes into a
    block of byteps's host pool (byteps_py/buffers.py), returned when the result is freed, so a warm
    loop of out-of-place calls allocates nothing and takes no page faults."""
    src = tensor.detach()
    nbytes = src.numel() * src.element_size()
    if src.device.type != "cpu" or nbytes < MIN_POOLED_BYTES:
        return src.clone(memory_format=torch.contiguous_format)
    out = torch.from_numpy(pool.take(nbytes)).view(src.dtype).view(src.shape)
    out.copy_(src)
    return out


def _push_pull_sync(tensor, average, name, priority, compression, prefix="push_pull"):
    """A synchronous push_pull of ``tensor`` in place; unnamed calls get one name per dtype and shape
    (common.sync_name)."""
    if name is None:
        name = common.sync_name(prefix, str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape))
    return synchronize(_start(tensor, name, average, priority, compression=compression, sync=True))


def push_pull_inplace(tensor, average=True, name=None, version=0, priority=0, compression=None):
    """Synchronous :func:`push_pull_async_inplace`; returns ``tensor``. Unnamed calls share one name per
    dtype and shape (``push_pull.sync.<dtype>.<shape>``), so repeated calls reuse one key."""
    return _push_pull_sync(tensor, average, name, priority, compression)


class _PushPull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, version, priority, codec=None):
        ctx.average, ctx.name, ctx.codec = average, name, codec
        return _push_pull_sync(out_of_place(tensor), average, name, priority, codec)

    @staticmethod
    def backward(ctx, grad):
        name = None if ctx.name is None else f"{ctx.name}.grad"
        out = _push_pull_sync(out_of_place(grad), ctx.average, name, 0, ctx.codec, "push_pull.grad")
        return out, None, None, None, None, None


def push_pull(tensor, average=True, name=None, version=0, priority=0, compression=None):
    """Sum (or average) ``tensor`` over all workers and return the result as a new tensor.

    Differentiable: the gradient is push_pulled the same way.
    """
    codec = _wire(compression)
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    if torch.is_grad_enabled() and compressed.requires_grad:
        out = _PushPull.apply(compressed, average, name, version, priority, codec)
    else:  # nothing to differentiate: skip autograd's Function machinery (it costs time)
        out = _push_pull_sync(out_of_place(compressed), average, name, priority, codec)
    return compression.decompress(out, ctx)


def broadcast_async_(tensor, root_rank, name=None, priority=0, process_set=None):
    """Start replacing ``tensor`` on every worker by root_rank's ``tensor``; returns a handle.

    A real broadcast: only the root's bytes travel, so NaN/Inf on other ranks cannot leak.
    ``process_set`` (Horovod's): only its members take part; ``root_rank`` is a global rank among them.
    """
    return _start(tensor, name, False, priority, root=root_rank, pset=_wire_set(process_set))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """In-place broadcast from root_rank; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set=process_set))


def declare(name):
    """Accepted for BytePS compatibility: the scheduler assigns a key per tensor name when every worker
    first uses it (and checks shapes and dtypes agree), whatever the declaration order."""
    common._require()
