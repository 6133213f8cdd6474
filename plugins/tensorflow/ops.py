"""push_pull (allreduce) and broadcast on TensorFlow tensors, in eager mode and inside ``tf.function``.

Eager mode: each tensor is copied into a contiguous numpy array, whose flat ``uint8`` view goes to
:func:`byteps.common.submit`; the reply lands in that array, which becomes the result tensor. A
group of tensors is submitted first and synchronized afterwards, so their transfers overlap.

Graph mode (``tf.function``, ``model.fit``): one ``tf.py_function`` per call (per group for
gradients) runs the eager implementation at every execution. ``tf.function`` runs stateful ops
such as ``py_function`` in program order (automatic control dependencies), so every worker
starts its operations in the same order and unnamed operations get the same automatic names.
``py_function`` cannot be compiled by XLA: use ``jit_compile=False`` (Keras picks ``False`` on
CPU-only machines by default; set ``model.compile(..., jit_compile=False)`` on GPUs).

A floating-point tensor's average (without tensor compression) is divided by :func:`size` as the sum
is copied in, bit for bit as TensorFlow divides (common.submit's ``average_by``); the rest is applied
with TensorFlow ops outside the transfer: the average of a compressed tensor after decompressing it,
integer averages by floor division (as in ``byteps.torch``), the pre/post scale factors, and integer
scaling rounds down.
"""
import numpy as np
import tensorflow as tf

from byteps import common
from byteps.core import dtypes

from .compression import Compression, wire_codec

__all__ = ["Average", "Sum", "push_pull", "allreduce", "broadcast", "push_pull_group", "broadcast_group",
           "dtype_code"]

#: reduction ops (Horovod's names; BytePS used the same strings)
Average = "Average"
Sum = "Sum"

_TF_DTYPES = {tf.float32: dtypes.FLOAT32, tf.float64: dtypes.FLOAT64, tf.float16: dtypes.FLOAT16,
              tf.bfloat16: dtypes.BFLOAT16, tf.int32: dtypes.INT32, tf.int64: dtypes.INT64,
              tf.uint8: dtypes.UINT8, tf.int8: dtypes.INT8}


def dtype_code(dtype, name):
    """The wire dtype code of a tf dtype; TypeError naming the tensor if it is unsupported."""
    try:
        return _TF_DTYPES[tf.as_dtype(dtype)]
    except (KeyError, TypeError):
        supported = ", ".join(d.name for d in _TF_DTYPES)
        raise TypeError(f"byteps: tensor {name!r} has unsupported dtype {getattr(dtype, 'name', dtype)}; "
                        f"supported: {supported}") from None


def _display_name(tensor, name):
    if name is not None:
        return name
    try:
        return tensor.name  # graph tensors and variables
    except (AttributeError, ValueError):
        return "<unnamed tensor>"


def _resolve_op(average, op):
    if average is not None and op is not None:
        raise ValueError("byteps: pass either average= (deprecated) or op=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in (Average, Sum):
        raise ValueError(f"byteps: unsupported op {op!r}; supported: {Average!r}, {Sum!r}")
    return op


def _check_not_xla():
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise RuntimeError("byteps: push_pull/broadcast run through tf.py_function, which XLA cannot compile; "
                           "use tf.function(jit_compile=False) / model.compile(..., jit_compile=False)")


# ---------------------------------------------------------------------------------------- eager core


def _submit(value, name, root, asynchronous=False, codec=None, average_by=1):
    """Start one operation on an eager tensor; synchronize() returns the result as a numpy array.
    ``average_by``: a float tensor's sum is divided by it as it is copied in (common.submit)."""
    arr = np.array(value.numpy() if hasattr(value, "numpy") else value, copy=True, order="C")
    code = dtype_code(value.dtype, name)
    buf = arr.reshape(-1).view(np.uint8)
    return common.submit(name, buf, code, tuple(arr.shape), broadcast_root=root, finalize=lambda: arr,
                         asynchronous=asynchronous, compression=codec,
                         average_by=average_by if code in dtypes.FLOATING else 1)


def _run_eager(values, names, root, prefix, asynchronous=False, codec=None, average_by=1):
    """Submit every tensor, then wait for all of them; returns eager tensors in the same order."""
    names = [n if n is not None else common.auto_name(prefix) for n in names]
    for v, n in zip(values, names):  # refuse bad dtypes before anything is in flight
        dtype_code(v.dtype, n)
    handles, error = [], None
    try:
        for v, n in zip(values, names):
            handles.append(_submit(v, n, root, asynchronous, codec, average_by))
    except BaseException as e:  # still wait for what was started, so no handle leaks
        error = e
    results = []
    for h in handles:
        try:
            results.append(common.synchronize(h))
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
    return [tf.convert_to_tensor(r, dtype=v.dtype) for r, v in zip(results, values)]


def _transfer(tensors, names, root, prefix, op_name, asynchronous=False, codec=None, average_by=1):
    """Sum (root None) or broadcast a list of tensors; eager or through one tf.py_function. ``average_by``:
    float sums are divided by it on their way in (integers are left to the caller)."""
    if not tensors:
        return []
    if tf.executing_eagerly():
        return _run_eager(tensors, names, root, prefix, asynchronous, codec, average_by)
    for t, n in zip(tensors, names):  # fail at trace time, naming the tensor
        dtype_code(t.dtype, _display_name(t, n))
    _check_not_xla()
    names = list(names)

    def body(*values):
        return _run_eager(values, names, root, prefix, asynchronous, codec, average_by)

    outs = tf.py_function(body, inp=list(tensors), Tout=[t.dtype for t in tensors], name=op_name)
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return list(outs)


# ----------------------------------------------------------------------------------------- scaling


def _scale(tensor, factor):
    if factor == 1:
        return tensor
    if tensor.dtype.is_floating:
        return tensor * tf.cast(factor, tensor.dtype)
    # integers: scale in float64 and round down
    return tf.cast(tf.math.floor(tf.cast(tensor, tf.float64) * float(factor)), tensor.dtype)


def _divide(tensor, n):
    if n == 1:
        return tensor
    if tensor.dtype.is_floating:
        return tensor / tf.cast(n, tensor.dtype)
    return tf.math.floordiv(tensor, tf.cast(n, tensor.dtype))


def _reduce_group(tensors, names, op, prescale, postscale, compression, prefix="tf.push_pull"):
    """push_pull a list of tensors (no gradient): compress, prescale, sum, average, postscale, decompress."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t, n in zip(tensors, names):
        dtype_code(t.dtype, _display_name(t, n))
    size = common.size()
    compressed, ctxs = [], []
    for t in tensors:
        c, ctx = compression.compress(_scale(t, prescale))
        compressed.append(c)
        ctxs.append(ctx)
    # a float average without tensor compression is divided as the sum is copied in (no pass of its own);
    # a compressed tensor is averaged after decompress, as before
    fold = op == Average and compression is Compression.none
    summed = _transfer(compressed, names, None, prefix, "BytePSPushPull", codec=wire_codec(compression),
                       average_by=size if fold else 1)
    out = []
    for s, ctx in zip(summed, ctxs):
        s = compression.decompress(s, ctx)
        if op == Average and not (fold and s.dtype.is_floating):
            s = _divide(s, size)
        out.append(_scale(s, postscale))
    return out


def push_pull_group(tensors, names=None, op=Average, compression=Compression.none, prescale_factor=1.0,
                    postscale_factor=1.0, prefix="tf.push_pull"):
    """push_pull several tensors at once (all submitted before any is awaited); not differentiable.

    ``names`` is a list with one name (or None: automatic) per tensor. Returns new tensors.
    """
    tensors = list(tensors)
    names = list(names) if names is not None else [None] * len(tensors)
    if len(names) != len(tensors):
        raise ValueError(f"byteps: {len(tensors)} tensors but {len(names)} names")
    return _reduce_group(tensors, names, _resolve_op(None, op), prescale_factor, postscale_factor, compression,
                         prefix)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0):
    """Sum or average ``tensor`` over all workers; returns a new tensor (Horovod's name and arguments).

    Args:
        tensor: a tf.Tensor (or anything convertible: variables, numpy arrays).
        average: deprecated; ``True`` means ``op=Average``, ``False`` ``op=Sum``.
        name: the same on every worker. Unnamed calls get ``tf.push_pull.noname.<n>``, numbered in
            call order (inside tf.function: at each execution), so they never collide; name
            tensors that are push_pulled repeatedly, or every call declares a new tensor.
        compression: ``Compression.none`` or ``Compression.fp16`` (on the tensor), or a wire compressor
            (``Compression.onebit(error_feedback=True)``, ``.topk``, ...; docs/compression.md).
        op: ``Average`` (default) or ``Sum``.
        prescale_factor, postscale_factor: multiply before the sum / after the average.

    Differentiable: the gradient is push_pulled with the same op and factors.
    """
    op = _resolve_op(average, op)
    tensor = tf.convert_to_tensor(tensor)
    dtype_code(tensor.dtype, _display_name(tensor, name))

    def reduce(x, nm):
        return _reduce_group([x], [nm], op, prescale_factor, postscale_factor, compression)[0]

    if not tensor.dtype.is_floating:
        return reduce(tensor, name)

    @tf.custom_gradient
    def _pp(x):
        def grad(dy):
            return reduce(tf.convert_to_tensor(dy), None if name is None else f"{name}.grad")

        return reduce(x, name), grad

    return _pp(tensor)


def push_pull(tensor, average=None, name=None, compression=Compression.none, op=None):
    """BytePS's name for :func:`allreduce` (default op: Average)."""
    return allreduce(tensor, average=average, name=name, compression=compression, op=op)


def broadcast_group(tensors, root_rank, names=None, prefix="tf.broadcast"):
    """Broadcast several tensors from ``root_rank`` at once; returns new tensors (not differentiable)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    names = list(names) if names is not None else [None] * len(tensors)
    for t, n in zip(tensors, names):
        dtype_code(t.dtype, _display_name(t, n))
    if not 0 <= root_rank < common.size():
        raise ValueError(f"byteps: root rank {root_rank} is outside 0..{common.size() - 1}")
    return _transfer(tensors, names, root_rank, prefix, "BytePSBroadcast")


def broadcast(tensor, root_rank, name=None):
    """Return ``root_rank``'s ``tensor`` on every worker, as a new tensor.

    A real broadcast: only the root's bytes travel, so NaN/Inf on other ranks cannot leak. The
    gradient (as in Horovod) is the sum of the incoming gradients on the root and zero elsewhere.
    """
    tensor = tf.convert_to_tensor(tensor)
    dtype_code(tensor.dtype, _display_name(tensor, name))
    if not tensor.dtype.is_floating:
        return broadcast_group([tensor], root_rank, [name])[0]

    @tf.custom_gradient
    def _bc(x):
        def grad(dy):
            g = _reduce_group([tf.convert_to_tensor(dy)], [None if name is None else f"{name}.grad"], Sum, 1.0,
                              1.0, Compression.none)[0]
            return g if common.rank() == root_rank else tf.zeros_like(g)

        return broadcast_group([x], root_rank, [name])[0], grad

    return _bc(tensor)
