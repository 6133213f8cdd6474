"""push_pull (allreduce) and broadcast on TensorFlow tensors, in eager mode and inside ``tf.function``.

Eager calls go through numpy copies of the tensors; in a graph, each call is one ``tf.py_function``
running the eager code (not under XLA). How graph ops are ordered and named, how averages are divided
and which errors workers get: docs/compat.md ("How byteps.tensorflow runs")."""
import itertools
import weakref

import numpy as np
import tensorflow as tf

from byteps import common
from byteps.core import dtypes
from byteps.errors import TensorMismatchError
from byteps.log import logger

from .compression import Compression, wire_codec

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "broadcast", "push_pull_group",
           "broadcast_group", "dtype_code"]

#: reduction ops (Horovod's names; BytePS used the same strings)
Average = "Average"
Sum = "Sum"
Min = "Min"
Max = "Max"
Product = "Product"
Adasum = "Adasum"

_TF_DTYPES = {tf.float32: dtypes.FLOAT32, tf.float64: dtypes.FLOAT64, tf.float16: dtypes.FLOAT16,
              tf.bfloat16: dtypes.BFLOAT16, tf.int32: dtypes.INT32, tf.int64: dtypes.INT64,
              tf.uint8: dtypes.UINT8, tf.int8: dtypes.INT8}


#: dtypes that operations which only copy bytes (broadcast, allgather, alltoall) move as uint8
_MOVE_ONLY = {tf.bool: 1, tf.int16: 2, tf.uint16: 2}


def dtype_code(dtype, name, move=False):
    """The wire dtype code of a tf dtype (``move``: the operation only copies bytes, so bool, int16 and
    uint16 go as uint8); TypeError naming the tensor if it is unsupported."""
    try:
        dtype = tf.as_dtype(dtype)
        if move and dtype in _MOVE_ONLY:
            return dtypes.UINT8
        return _TF_DTYPES[dtype]
    except (KeyError, TypeError):
        supported = ", ".join(d.name for d in _TF_DTYPES)
        moved = ", ".join(d.name for d in _MOVE_ONLY)
        raise TypeError(f"byteps: tensor {name!r} has unsupported dtype {getattr(dtype, 'name', dtype)}; "
                        f"supported: {supported} (and {moved} for broadcast, allgather and alltoall)") from None


def wire_shape(arr):
    """The shape declared for numpy array ``arr``: a move-only dtype's element bytes become a last dimension."""
    if arr.dtype in (np.int16, np.uint16):
        return (*arr.shape, arr.dtype.itemsize)
    return tuple(arr.shape)


_GRAPHS = weakref.WeakKeyDictionary()  # graph -> its byteps bookkeeping (graphs take no attributes)
_GRAPH_NUMBERS = itertools.count()  # graphs in the order they first hold a byteps op


def _graph_state():
    graph = tf.compat.v1.get_default_graph()
    state = _GRAPHS.get(graph)
    if state is None:
        state = _GRAPHS[graph] = {"unnamed": {}, "last_op": None, "ran": False, "number": next(_GRAPH_NUMBERS)}
    return state


def graph_name(prefix, name):
    """``name``, or for an unnamed op built into a graph its job-unique name (the same on every worker
    building the same graphs); None for an eager call (numbered when it runs)."""
    if name is not None or tf.executing_eagerly():
        return name
    # per graph in build order, whatever the name scope (tf.custom_gradient opens one only on the ranks
    # whose tensor is differentiable); a later graph never reuses a name (docs/compat.md)
    state = _graph_state()
    counts = state["unnamed"]
    counts[prefix] = counts.get(prefix, -1) + 1
    return f"{prefix}.noname.graph{state['number']}.{counts[prefix]}"


def graph_call(fn, inputs, out_dtypes, op_name, what):
    """``fn(*eager tensors) -> outputs`` as one tf.py_function of the graph being built.

    In a TF1 graph an op built after another, with no run in between, gets a control edge to it (an op
    built after a run starts a new chain, so a build-and-run loop does not re-run earlier ops);
    ``tf.function`` orders stateful ops itself. A py_function turns every exception into UnknownError,
    so a mismatch (workers disagree on ``what``) comes back as a flag, turned into Horovod's
    FailedPreconditionError naming ``what`` by a read of a variable that does not exist."""
    state = None if tf.inside_function() else _graph_state()

    def body(*xs):
        if state is not None:
            state["ran"] = True
        try:
            return [*fn(*xs), True]
        except (TensorMismatchError, tf.errors.FailedPreconditionError) as e:
            logger.error("%s", e)
            return [tf.zeros([0], d) for d in out_dtypes] + [False]

    def make():
        return tf.py_function(body, inp=list(inputs), Tout=[*out_dtypes, tf.bool], name=op_name)

    last = None if state is None or state["ran"] else state["last_op"]
    try:
        with tf.control_dependencies([last] if last is not None else []):
            *outs, ok = make()
    except ValueError:  # the previous op sits in another control-flow context: no edge can reach it
        *outs, ok = make()
    if state is not None:
        state["last_op"], state["ran"] = ok.op, False

    def fail():
        reason = (f"byteps: the workers disagree on {what} (shape, dtype or root rank; the worker log names each "
                  "rank's)")
        handle = tf.raw_ops.VarHandleOp(dtype=tf.bool, shape=[], shared_name=reason, container="byteps")
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.bool)

    check = tf.cond(ok, lambda: tf.constant(True), fail)
    with tf.control_dependencies([check]):
        return [tf.identity(o) for o in outs]


def as_tf_error(error):
    """Horovod's error class for workers that disagree on a tensor: tf.errors.FailedPreconditionError."""
    if isinstance(error, TensorMismatchError):
        return tf.errors.FailedPreconditionError(None, None, str(error))
    return error


def wait_all(handles, error=None):
    """Synchronize every handle and return the results; once all are done, raise the first error (or
    ``error``, raised before) as Horovod's error class."""
    results = []
    for h in handles:
        try:
            results.append(common.synchronize(h))
        except BaseException as e:
            error = error or e
    if error is not None:
        raise as_tf_error(error)
    return results


def check_dtypes(tensors, names, prefix, move=False, first_ops=None):
    """Refuse a call whose tensors byteps cannot move (TypeError naming the tensor), on every rank: this
    rank abandons the operations the call would have started, under the names they would have had, so
    the other ranks fail at once naming it (common.abandon) and automatic names stay in step.
    ``first_ops(name)``: the operations a collective of several steps starts first (default ``[name]``)."""
    try:
        for t, n in zip(tensors, names):
            dtype_code(t.dtype, _display_name(t, n), move=move)
    except TypeError as e:
        for n in names:
            full = graph_name(prefix, n) or common.auto_name(prefix)
            for op_name in (first_ops(full) if first_ops else [full]):
                common.abandon(op_name, None, e)
        raise


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
    if op == Adasum:
        raise NotImplementedError("byteps does not implement Adasum; use op=Average or Sum")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"byteps: unsupported op {op!r}; supported: Average, Sum, Min, Max, Product")
    return op


def check_global_set(process_set):
    """TensorFlow's process sets are not supported: only None / the global set (id 0) is accepted."""
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise NotImplementedError("byteps.tensorflow supports the global process set only (process sets are "
                                  "available in byteps.torch)")


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
    code = dtype_code(value.dtype, name, move=root is not None)
    buf = arr.reshape(-1).view(np.uint8)
    return common.submit(name, buf, code, wire_shape(arr), broadcast_root=root, finalize=lambda: arr,
                         asynchronous=asynchronous, compression=codec,
                         average_by=average_by if code in dtypes.FLOATING else 1)


def _run_eager(values, names, root, prefix, asynchronous=False, codec=None, average_by=1):
    """Submit every tensor, then wait for all of them; returns eager tensors in the same order."""
    names = [n if n is not None else common.auto_name(prefix) for n in names]
    check_dtypes(values, names, prefix, move=root is not None)  # before anything is in flight
    handles, error = [], None
    try:
        for v, n in zip(values, names):
            handles.append(_submit(v, n, root, asynchronous, codec, average_by))
    except BaseException as e:  # still wait for what was started, so no handle leaks
        error = e
    results = wait_all(handles, error)
    return [tf.convert_to_tensor(r, dtype=v.dtype) for r, v in zip(results, values)]


def _transfer(tensors, names, root, prefix, op_name, asynchronous=False, codec=None, average_by=1):
    """Sum (root None) or broadcast a list of tensors; eager or through one tf.py_function. ``average_by``:
    float sums are divided by it on their way in (integers are left to the caller)."""
    if not tensors:
        return []
    if tf.executing_eagerly():
        return _run_eager(tensors, names, root, prefix, asynchronous, codec, average_by)
    for t, n in zip(tensors, names):  # fail at trace time, naming the tensor
        dtype_code(t.dtype, _display_name(t, n), move=root is not None)
    _check_not_xla()
    names = [graph_name(prefix, n) for n in names]

    def body(*values):
        return _run_eager(values, names, root, prefix, asynchronous, codec, average_by)

    outs = graph_call(body, tensors, [t.dtype for t in tensors], op_name,
                      "tensors " + ", ".join(repr(n if n is not None else prefix) for n in names))
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return list(outs)


# ----------------------------------------------------------------------------------------- scaling


def _scale(tensor, factor):
    """Horovod's scaling: float16 in float32, integers in float64 truncated toward zero."""
    if factor == 1:
        return tensor
    if tensor.dtype == tf.float16:
        return tf.cast(tf.cast(tensor, tf.float32) * float(factor), tf.float16)
    if tensor.dtype.is_floating:
        return tensor * tf.cast(factor, tensor.dtype)
    return tf.cast(tf.cast(tensor, tf.float64) * float(factor), tensor.dtype)  # the cast truncates


def _divide(tensor, n):
    if n == 1:
        return tensor
    if tensor.dtype.is_floating:
        return tensor / tf.cast(n, tensor.dtype)
    return tf.truncatediv(tensor, tf.cast(n, tensor.dtype))  # toward zero, as Horovod


def _reduce_group(tensors, names, op, prescale, postscale, compression, prefix="tf.push_pull"):
    """push_pull a list of tensors (no gradient): compress, prescale, sum, average, postscale, decompress."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    check_dtypes(tensors, names, prefix)
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


def broadcast_group(tensors, root_rank, names=None, prefix="tf.broadcast"):
    """Broadcast several tensors from ``root_rank`` at once; returns new tensors (not differentiable)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    names = list(names) if names is not None else [None] * len(tensors)
    check_dtypes(tensors, names, prefix, move=True)
    if not 0 <= root_rank < common.size():
        raise ValueError(f"byteps: root rank {root_rank} is outside 0..{common.size() - 1}")
    return _transfer(tensors, names, root_rank, prefix, "BytePSBroadcast")


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=None):
    """Return ``root_rank``'s ``tensor`` on every worker, as a new tensor.

    A real broadcast: only the root's bytes travel, so NaN/Inf on other ranks cannot leak; any dtype
    moves, bool, int16 and uint16 included. The gradient (as in Horovod) is the average of the incoming
    gradients on the root and zero elsewhere. ``ignore_name_scope``, ``process_set`` (the global one): Horovod's.
    """
    check_global_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    check_dtypes([tensor], [name], "tf.broadcast", move=True)
    if not tensor.dtype.is_floating:
        return broadcast_group([tensor], root_rank, [name])[0]

    @tf.custom_gradient
    def _bc(x):
        def grad(dy):
            g = _reduce_group([tf.convert_to_tensor(dy)], [None if name is None else f"{name}.grad"], Average, 1.0,
                              1.0, Compression.none)[0]
            # g * 0, not zeros_like(g): in a graph zeros_like of a known shape is a constant, so the
            # push_pull would never run on the other ranks and the root would wait for them (as Horovod)
            return g if common.rank() == root_rank else g * tf.constant(0, g.dtype)

        return broadcast_group([x], root_rank, [name])[0], grad

    return _bc(tensor)

