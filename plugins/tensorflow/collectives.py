"""Horovod's TensorFlow collectives (``allreduce`` and the rest) over ops.py's transfer: push_pull for
Average and Sum, broadcasts for allgather, alltoall and Min/Max/Product (docs/compat.md says how each
travels). Eager calls run at once; in a graph each call is one ``tf.py_function``. Workers that
disagree on a tensor get ``tf.errors.FailedPreconditionError``. Only the global process set."""
import numpy as np
import tensorflow as tf

from byteps import common
from byteps.splits import send_table, splits_row

from .compression import Compression
from .ops import (Average, Max, Min, Product, Sum, _reduce_group, _resolve_op, _scale, check_dtypes, check_global_set,
                  dtype_code, graph_call, graph_name, wait_all, wire_shape)


# --------------------------------------------------------------------------------- numpy level

def _start(arr, name, root=None):
    """Submit a sum (root None) or a broadcast of contiguous numpy ``arr`` in place; returns a handle."""
    code = dtype_code(arr.dtype, name, move=root is not None)
    return common.submit(name, arr.reshape(-1).view(np.uint8), code, wire_shape(arr), broadcast_root=root)


def gather_np(arr, name):
    """Every rank's ``arr`` concatenated along dim 0 (a scalar counts as one row): (result, row counts)."""
    arr = np.ascontiguousarray(arr)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    n, me = common.size(), common.rank()
    counts = np.zeros(n, dtype=np.int64)
    counts[me] = arr.shape[0]
    wait_all([_start(counts, f"{name}.sizes")])
    offsets = np.concatenate([[0], np.cumsum(counts)])
    out = np.empty((int(offsets[-1]),) + arr.shape[1:], dtype=arr.dtype)
    out[offsets[me]:offsets[me + 1]] = arr
    wait_all([_start(out[offsets[r]:offsets[r + 1]], f"{name}.{r}", root=r) for r in range(n) if counts[r] > 0])
    return out, counts


def _gather_reduce_np(arr, op, name):
    arr = np.ascontiguousarray(arr)
    parts = [arr if r == common.rank() else np.empty_like(arr) for r in range(common.size())]
    wait_all([_start(p, f"{name}.{r}", root=r) for r, p in enumerate(parts)])
    stacked = np.stack(parts)
    if op == Min:
        return stacked.min(0)
    if op == Product:
        return stacked.prod(0, dtype=arr.dtype)
    return stacked.max(0)


def _alltoall_np(arr, splits, name):
    """Every rank's dim 0 and splits are gathered and checked first (byteps/splits.py), then the rows."""
    n, me = common.size(), common.rank()
    arr = np.ascontiguousarray(arr)
    row = splits_row(arr.shape[0] if arr.ndim else -1, splits, n)
    gathered, _ = gather_np(row.reshape(1, n + 2), f"{name}.splits")
    table = send_table(name, gathered)  # table[src][dst]: rows src sends to dst
    rows, _ = gather_np(arr[:table[me].sum()], f"{name}.data")
    starts = np.concatenate([[0], np.cumsum(table.sum(1))])
    pieces = []
    for src in range(n):
        first = starts[src] + table[src, :me].sum()
        pieces.append(rows[first:first + table[src, me]])
    return np.concatenate(pieces), np.ascontiguousarray(table[:, me]).astype(np.int32)


# ------------------------------------------------------------------------------ TensorFlow level

def _run(fn, inputs, out_dtypes, op_name, what):
    """``fn(*numpy inputs) -> numpy outputs`` now (eager) or as one tf.py_function (graph)."""
    if tf.executing_eagerly():  # bad arguments: InvalidArgumentError, as a py_function makes of a ValueError
        try:
            outs = fn(*[t.numpy() for t in inputs])
        except ValueError as e:
            raise tf.errors.InvalidArgumentError(None, None, str(e)) from e
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, out_dtypes)]
    return graph_call(lambda *xs: [np.asarray(o) for o in fn(*[x.numpy() for x in xs])], inputs, out_dtypes, op_name,
                      what)


def _named(prefix, name):
    """(run-time namer, what to call the tensor in an error): eager unnamed calls are numbered as they run."""
    fixed = graph_name(prefix, name)
    return (lambda: fixed if fixed is not None else common.auto_name(prefix)), repr(fixed or prefix)


def _allgather_raw(tensor, name=None):
    tensor = tf.convert_to_tensor(tensor)
    check_dtypes([tensor], [name], "tf.allgather", move=True, first_ops=lambda n: [f"{n}.sizes"])
    namer, what = _named("tf.allgather", name)
    out, = _run(lambda x: [gather_np(x, namer())[0]], [tensor], [tensor.dtype], "BytePSAllgather", what)
    if tensor.shape.rank is not None:
        out.set_shape([None] + tensor.shape.as_list()[1:] if tensor.shape.rank else [None])
    return out


def allgather(tensor, name=None, ignore_name_scope=False, process_set=None):
    """Every rank's ``tensor`` concatenated along dim 0, in rank order (dim-0 sizes may differ).
    Differentiable for floats: the gradient is the upstream gradient averaged over the ranks, this rank's rows."""
    check_global_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        return _allgather_raw(tensor, name)

    @tf.custom_gradient
    def _ag(x):
        def grad(dy):
            reduced = allreduce(tf.convert_to_tensor(dy), op=Average, name=None if name is None else f"{name}.grad")
            counts = _allgather_raw(tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1]),
                                    None if name is None else f"{name}.grad.counts")
            return _rows(reduced, tf.reduce_sum(counts[:common.rank()]), counts[common.rank()])

        return _allgather_raw(x, name), grad

    return _ag(tensor)


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=None):
    """One allgather per tensor (names ``<name>.<i>``)."""
    return [allgather(t, name=None if name is None else f"{name}.{i}", process_set=process_set)
            for i, t in enumerate(tensors)]


def gather_reduce(tensor, op, name, prescale_factor=1.0, postscale_factor=1.0):
    """allreduce with Min, Max or Product (not differentiable, as in Horovod)."""
    tensor = _scale(tf.convert_to_tensor(tensor), prescale_factor)
    prefix = f"tf.{op.lower()}"
    check_dtypes([tensor], [name], prefix, first_ops=lambda n: [f"{n}.{r}" for r in range(common.size())])
    namer, what = _named(prefix, name)
    out, = _run(lambda x: [_gather_reduce_np(x, op, namer())], [tensor], [tensor.dtype], f"BytePS{op}", what)
    out.set_shape(tensor.shape)
    return _scale(out, postscale_factor)


def allreduce_indexed_slices(slices, op, name, prescale_factor, postscale_factor):
    """Horovod's allreduce of a tf.IndexedSlices: values and indices allgathered; Average divides the values."""
    if op not in (Average, Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = allgather(slices.values, name=None if name is None else f"{name}.values")
    indices = allgather(slices.indices, name=None if name is None else f"{name}.indices")
    if op == Average:  # TensorFlow's true division, as Horovod: integer values become floats
        values = values / tf.cast(common.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _alltoall_raw(tensor, splits, name):
    namer, what = _named("tf.alltoall", name)
    inputs = [tensor] if splits is None else [tensor, tf.cast(splits, tf.int64)]
    out, received = _run(lambda x, s=None: _alltoall_np(x, s, namer()), inputs, [tensor.dtype, tf.int32],
                         "BytePSAlltoall", what)
    if tensor.shape.rank:
        out.set_shape([None] + tensor.shape.as_list()[1:])
    received.set_shape([common.size()])
    return out, received


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=None):
    """Send ``splits[i]`` rows of ``tensor`` (dim 0; equal blocks without ``splits``) to rank i; returns the
    rows received in source-rank order, and with ``splits`` also ``received_splits`` (Horovod's: a pair
    only when splits are given). Differentiable for floats."""
    check_global_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    check_dtypes([tensor], [name], "tf.alltoall", move=True, first_ops=lambda n: [f"{n}.splits.sizes"])
    if not tensor.dtype.is_floating:
        out, received = _alltoall_raw(tensor, splits, name)
        return out if splits is None else (out, received)

    @tf.custom_gradient
    def _a2a(x):
        out, received = _alltoall_raw(x, splits, name)

        def grad(dy, _unused=None):
            back, _ = _alltoall_raw(tf.convert_to_tensor(dy), received, None if name is None else f"{name}.grad")
            return tf.reshape(back, tf.shape(x))

        return (out, received), grad

    out, received = _a2a(tensor)
    return out if splits is None else (out, received)


def _rows(tensor, begin, count):
    """``count`` rows of ``tensor`` from row ``begin`` (int64 scalars, known in a graph only when it runs)."""
    rest = tf.rank(tensor) - 1
    return tf.slice(tensor, tf.concat([[begin], tf.zeros([rest], tf.int64)], 0),
                    tf.concat([[count], tf.fill([rest], tf.constant(-1, tf.int64))], 0))


def _block(tensor, n, me):
    """This rank's block of dim 0: the first ``dim0 % n`` ranks get one row more."""
    rows = tf.shape(tensor, out_type=tf.int64)[0]
    base, extra = rows // n, rows % n
    return _rows(tensor, me * base + tf.minimum(tf.constant(me, tf.int64), extra), base + tf.cast(me < extra, tf.int64))


def _check_reducescatter(tensor, op):
    if op not in (Average, Sum):
        raise NotImplementedError("reducescatter supports the Average and Sum ops only")
    if tensor.shape.rank == 0:
        raise ValueError("reducescatter does not support scalar inputs")


def grouped_reducescatter(tensors, device_dense="", compression=None, op=Average, name=None, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Reduce every tensor (one group) and keep this rank's block of each. Differentiable for floats:
    the gradient is the allgathered upstream gradient (times ``size`` for Sum, as Horovod)."""
    check_global_set(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_reducescatter(t, op)
    n, me = common.size(), common.rank()
    names = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]

    def forward(xs):
        summed = _reduce_group(xs, names, op, prescale_factor, postscale_factor, compression or Compression.none,
                               prefix="tf.reducescatter")
        return [_block(s, n, me) for s in summed]

    if not all(t.dtype.is_floating for t in tensors):
        return forward(tensors)

    @tf.custom_gradient
    def _rs(*xs):
        def grad(*dys):
            factor = n if op == Sum else 1
            return [_scale(allgather(tf.convert_to_tensor(dy), name=None if nm is None else f"{nm}.grad"), factor)
                    for dy, nm in zip(dys, names)]

        return forward(list(xs)), grad

    return _rs(*tensors)


def reducescatter(tensor, device_dense="", compression=None, op=Average, name=None, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks (Average or Sum) and keep this rank's block of dim 0."""
    return grouped_reducescatter([tensor], device_dense, compression, op, name, process_set, prescale_factor,
                                 postscale_factor)[0]


# ------------------------------------------------------------------------------- allreduce

def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, device_dense="", device_sparse="", process_set=None, ignore_name_scope=False):
    """Sum or average ``tensor`` over all workers; returns a new tensor (Horovod's name and arguments).

    Args:
        tensor: a tf.Tensor (or anything convertible: variables, numpy arrays).
        average: deprecated; ``True`` means ``op=Average``, ``False`` ``op=Sum``.
        name: the same on every worker. Unnamed calls get ``tf.push_pull.noname.<n>``, numbered in
            call order (inside tf.function: at each execution), so they never collide; name
            tensors that are push_pulled repeatedly, or every call declares a new tensor.
        compression: ``Compression.none`` or ``Compression.fp16`` (on the tensor), or a wire compressor
            (``Compression.onebit(error_feedback=True)``, ``.topk``, ...; docs/compression.md).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor, postscale_factor: multiply before the sum / after the average.
        device_dense, device_sparse, ignore_name_scope: Horovod's, accepted; process_set: only the
            global one (TensorFlow process sets are not supported).

    A ``tf.IndexedSlices`` is allgathered (values and indices), as Horovod does: Sum or Average only.
    Differentiable: the gradient is push_pulled with the same op and factors.
    """
    check_global_set(process_set)
    op = _resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        return allreduce_indexed_slices(tensor, op, name, prescale_factor, postscale_factor)
    if op in (Min, Max, Product):
        return gather_reduce(tensor, op, name, prescale_factor, postscale_factor)
    return _reduce_differentiable([tf.convert_to_tensor(tensor)], [name], op, prescale_factor, postscale_factor,
                                  compression, "tf.push_pull")[0]


def push_pull(tensor, average=None, name=None, compression=Compression.none, op=None):
    """BytePS's name for :func:`allreduce` (default op: Average)."""
    return allreduce(tensor, average=average, name=name, compression=compression, op=op)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None, name=None):
    """allreduce several tensors as one group (submitted together); Horovod's arguments. Min/Max/Product
    and IndexedSlices go one by one. Differentiable: the gradients are reduced as one group too."""
    check_global_set(process_set)
    op = _resolve_op(average, op)
    tensors = list(tensors)
    names = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]
    if op in (Min, Max, Product) or any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, name=nm, compression=compression, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for t, nm in zip(tensors, names)]
    return _reduce_differentiable([tf.convert_to_tensor(t) for t in tensors], names, op, prescale_factor,
                                  postscale_factor, compression, "tf.grouped_allreduce")


def _reduce_differentiable(tensors, names, op, prescale_factor, postscale_factor, compression, prefix):
    """ops._reduce_group, differentiable when every tensor is a float: the gradients are reduced as one
    group, with the same op and factors."""
    def reduce(xs, nms):
        return _reduce_group(xs, nms, op, prescale_factor, postscale_factor, compression, prefix)

    if not all(t.dtype.is_floating for t in tensors):
        return reduce(tensors, names)

    @tf.custom_gradient
    def _group(*xs):
        def grad(*dys):
            return reduce([tf.convert_to_tensor(d) for d in dys], [None if n is None else f"{n}.grad" for n in names])

        return reduce(list(xs), names), grad

    return _group(*tensors)
