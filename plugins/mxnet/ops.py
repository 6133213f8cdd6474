"""push_pull and broadcast on MXNet NDArrays, through a host copy: ``tensor.asnumpy()`` (which waits for
pending writes) goes to the Summation Service in place, and ``synchronize`` writes the result back
with ``tensor[:] = result`` (docs/mxnet.md, "Limits")."""
import mxnet as mx
import numpy as np

from byteps import common
from byteps.core import dtypes

from .compression import wire_codec

__all__ = ["push_pull", "push_pull_async", "byteps_push_pull", "byteps_declare_tensor", "broadcast_",
           "broadcast_async_", "poll", "synchronize"]

#: numpy dtype name of an NDArray -> wire code. MXNet 1.9 has no CPU bfloat16 arithmetic.
_MX_DTYPES = {"float32": dtypes.FLOAT32, "float64": dtypes.FLOAT64, "float16": dtypes.FLOAT16,
              "int32": dtypes.INT32, "int64": dtypes.INT64, "uint8": dtypes.UINT8, "int8": dtypes.INT8}


def dtype_code(tensor, name):
    """Wire code of ``tensor``'s dtype; TypeError naming the tensor if it is not supported."""
    try:
        key = np.dtype(tensor.dtype).name
    except TypeError:
        key = str(tensor.dtype)
    try:
        return _MX_DTYPES[key]
    except KeyError:
        raise TypeError(f"byteps: tensor {name!r} has unsupported dtype {key}; supported: "
                        f"{', '.join(_MX_DTYPES)}") from None


def _check(tensor, name):
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"byteps: tensor {name!r} must be an mxnet NDArray, not {type(tensor).__name__}")
    stype = getattr(tensor, "stype", "default")
    if stype != "default":
        raise TypeError(f"byteps: tensor {name!r} has storage type {stype!r}; only dense NDArrays are supported")


def _start(tensor, name, average, priority, root=None, prefix="push_pull", asynchronous=False, compression=None):
    name = name if name is not None else common.auto_name(prefix)
    _check(tensor, name)
    code = dtype_code(tensor, name)
    size = common.size()
    # asnumpy() waits for pending writes (wait_to_read) and returns a fresh C-contiguous host copy.
    work = np.ascontiguousarray(tensor.asnumpy())
    # a float average: divided as the sum is copied in (common.submit), not in a pass of its own
    average_by = size if average and root is None and size > 1 and not asynchronous and code in dtypes.FLOATING else 1

    def finalize():
        if average and root is None and size > 1 and average_by == 1:
            if code in dtypes.FLOATING:
                np.divide(work, size, out=work)
            else:  # integer average: floor division, as in byteps.torch
                np.floor_divide(work, size, out=work)
        if work.size:
            tensor[:] = work
        return tensor

    return common.submit(name, work.reshape(-1).view(np.uint8), code, tuple(tensor.shape), broadcast_root=root,
                         priority=priority, finalize=finalize, asynchronous=asynchronous, average_by=average_by,
                         compression=wire_codec(compression) if compression not in (None, False) else compression)


def push_pull_async(tensor, average=True, name=None, priority=0, compression=None):
    """Start summing ``tensor`` over all workers; returns a handle.

    The result is written into ``tensor`` (in place) by :func:`synchronize`, which returns it.

    Args:
        tensor: a dense CPU ``mx.nd.NDArray`` (other contexts go through the same host copy, untested).
        average: divide by :func:`size` (floor division for integer tensors).
        name: the same on every worker and unique among in-flight operations; unnamed calls get
            ``push_pull.noname.<n>``, numbered in call order.
        priority: larger runs earlier when the pipeline has a choice.
        compression: a wire compressor (``Compression.onebit(...)``, ...; docs/compression.md) for
            the partitions that cross the network; None: the job's default (BYTEPS_COMPRESSOR).
    """
    return _start(tensor, name, average, priority, compression=compression)


def push_pull(tensor, average=True, name=None, priority=0, compression=None):
    """Sum (or average) ``tensor`` over all workers, in place; returns ``tensor``."""
    return synchronize(push_pull_async(tensor, average, name, priority, compression))


def byteps_push_pull(tensor, version=0, priority=0, name=None, is_average=True):
    """BytePS's name and signature. In place; unlike BytePS it returns only when the result is in
    ``tensor`` (BytePS queues the operation inside the MXNet engine). ``version`` is unused."""
    push_pull(tensor, average=is_average, name=name, priority=priority)


def byteps_declare_tensor(name, **kwargs):
    """Accepted for BytePS compatibility; does nothing. Keys do not depend on declaration order:
    the scheduler assigns one per name when every worker first uses it and checks shapes and dtypes
    agree. Compressor keyword arguments are ignored here: pass ``compression=`` to push_pull, or
    ``compression_params`` to DistributedTrainer (docs/compression.md)."""
    common._require()


def broadcast_async_(tensor, root_rank, name=None, priority=0):
    """Start replacing ``tensor`` on every worker by root_rank's ``tensor``; returns a handle.

    A real broadcast: only the root's bytes travel, so NaN/Inf on other ranks cannot leak.
    """
    return _start(tensor, name, False, priority, root=root_rank, prefix="broadcast")


def broadcast_(tensor, root_rank, name=None, priority=0):
    """Replace ``tensor`` (in place) by root_rank's values; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, priority))


def poll(handle):
    """True when the operation behind ``handle`` has finished."""
    return common.poll(handle)


def synchronize(handle):
    """Wait for ``handle``, write the result into its NDArray and return it (raises the operation's error)."""
    return common.synchronize(handle)


def _synchronize_copies(pending):
    """Wait for each ``(handle, arrays)`` (handle None: nothing to wait for), then copy ``arrays[0]``, which
    holds the result, into the other arrays (a Gluon Parameter's other contexts)."""
    for handle, arrays in pending:
        if handle is not None:
            synchronize(handle)
        for other in arrays[1:]:
            arrays[0].copyto(other)
