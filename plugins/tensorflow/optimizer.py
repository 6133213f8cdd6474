"""DistributedGradientTape (TF2 custom loops) and DistributedOptimizer (Keras 3 optimizers, ``model.fit``)."""
import tensorflow as tf

from byteps import common

from .compression import Compression
from .ops import Average, _resolve_op, _transfer, push_pull_group

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer"]


def _densify(grad):
    if isinstance(grad, tf.IndexedSlices):  # sparse gradients (embeddings) travel dense
        return tf.convert_to_tensor(grad)
    return grad


def _reduce_grads(grads, names, op, compression, prescale=1.0, postscale=1.0):
    """push_pull the non-None gradients as one group; None stays None."""
    live = [i for i, g in enumerate(grads) if g is not None]
    if not live:
        return list(grads)
    reduced = push_pull_group([_densify(grads[i]) for i in live], [names[i] for i in live], op=op,
                              compression=compression, prescale_factor=prescale, postscale_factor=postscale)
    out = list(grads)
    for i, r in zip(live, reduced):
        out[i] = r
    return out


# ------------------------------------------------------------------------------------- gradient tape


class _DistributedGradientTapeMixin:
    def register_local_source(self, source):
        """Horovod's: ``source``'s gradient stays this worker's own (model-parallel variables); it is divided
        by the number of workers when the tape was made with ``scale_local_gradients=True`` (the default)."""
        self._bps_local.add(id(source))

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        if common.size() <= 1:
            return grads
        flat = tf.nest.flatten(grads, expand_composites=False)
        local = [id(s) in self._bps_local for s in tf.nest.flatten(sources, expand_composites=False)]
        if len(local) != len(flat):
            local = [False] * len(flat)
        names = [f"{self._bps_prefix}{i}" for i in range(len(flat))]
        shared = _reduce_grads([None if lo else g for g, lo in zip(flat, local)], names, self._bps_op,
                               self._bps_compression)
        reduced = [(_divide_local(g) if self._bps_scale_local and g is not None else g) if lo else r
                   for g, r, lo in zip(flat, shared, local)]
        return tf.nest.pack_sequence_as(grads, reduced)


def _divide_local(grad):
    """A local source's gradient divided by the number of workers (an embedding's stays IndexedSlices)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / common.size(), grad.indices, grad.dense_shape)
    return grad / common.size()


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=True, op=Average, name=None, process_set=None, scale_local_gradients=True,
                            **_horovod_only):
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged over all workers.

    Use it after recording (``tape = bps.DistributedGradientTape(tape)``) or around a fresh tape
    (``with bps.DistributedGradientTape(tf.GradientTape()) as tape:``); the gradients travel as one
    group. Gradient ``i`` (position in the flattened ``sources``) is named ``<name or
    "DistributedGradientTape">.Gradient.<i>``, so every worker must pass the same sources in the same
    order. ``None`` gradients are skipped (on every worker alike); ``IndexedSlices`` are made dense.
    ``device_*`` and ``sparse_as_dense`` are accepted for compatibility. ``register_local_source(v)``
    keeps a variable's gradient local (Horovod's model parallelism; divided by the number of workers
    with ``scale_local_gradients``). Returns a subclass of the tape's class sharing its recording.
    """
    base = gradtape.__class__
    cls = type(base.__name__, (_DistributedGradientTapeMixin, base), {"__module__": base.__module__})
    tape = cls(persistent=gradtape._persistent, watch_accessed_variables=gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape
    tape._watched_variables = gradtape._watched_variables
    tape._bps_op = _resolve_op(None, op)
    tape._bps_compression = compression
    tape._bps_prefix = f"{name or 'DistributedGradientTape'}.Gradient."
    tape._bps_local = set()
    tape._bps_scale_local = scale_local_gradients
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=True, op=Average, local_layers=None, scale_local_gradients=True,
                                   **_horovod_only):
    """Horovod's: a DistributedGradientTape whose ``local_layers``' trainable variables keep local gradients."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   scale_local_gradients=scale_local_gradients)
    layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers] if local_layers else []
    for layer in layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


# ----------------------------------------------------------------------------------- keras optimizer


class _DistributedOptimizerMixin:
    """Overrides ``apply`` (which ``apply_gradients`` and ``model.fit`` call) to push_pull the gradients
    first; clipping, loss-scale handling, weight decay and the update are the wrapped class's own."""

    def build(self, variables):
        was_built = self.built
        super().build(variables)
        if self._bps_async and not was_built:
            # asynchronous training: the parameters last pulled from the servers (docs/async.md)
            self._bps_old = [self.add_variable_from_reference(v, name="bps_async_pulled") for v in variables]
            self._bps_async_ready = self.add_variable(shape=(), dtype="bool", initializer="zeros",
                                                      name="bps_async_initialised")
        if self._bps_passes > 1 and not was_built:
            self._bps_accumulators = [self.add_variable_from_reference(v, name="bps_gradient_accumulator")
                                      for v in variables]
            self._bps_pass_count = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                                     name="bps_backward_passes")

    def _bps_names(self, variables):
        return [f"{self._bps_prefix}{self._get_variable_index(v)}" for v in variables]

    def _bps_reduce(self, grads, variables):
        return _reduce_grads(grads, self._bps_names(variables), self._bps_op, self._bps_compression,
                             *self._bps_scale)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            return super().apply(grads, trainable_variables)
        if trainable_variables is None:
            if not self.built:
                return super().apply(grads, trainable_variables)  # raises Keras' own error
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
            if not self.built:
                self.build(variables)
        if self._bps_async:
            return self._bps_apply_async(grads, variables, trainable_variables)
        if self._bps_passes == 1:
            if common.size() > 1:
                grads = self._bps_reduce(grads, variables)
            return super().apply(grads, trainable_variables)
        return self._bps_apply_accumulated(grads, variables, trainable_variables)

    def _bps_apply_async(self, grads, variables, trainable_variables):
        """BYTEPS_ENABLE_ASYNC: update locally, push ``new - old`` and continue from the servers' latest
        parameters. The first call first adopts rank 0's parameters (the servers keep them)."""
        names = [f"{self._bps_prefix}Async.{self._get_variable_index(v)}" for v in variables]
        old = [self._bps_old[self._get_variable_index(v)] for v in variables]

        def adopt(values):
            for v, o, x in zip(variables, old, values):
                v.assign(x)
                o.assign(x)

        def initialise():
            adopt(_transfer([tf.convert_to_tensor(v) for v in variables], names, None, "tf.async", "bps_async_init",
                            asynchronous=True))
            self._bps_async_ready.assign(True)
            return tf.constant(True)

        tf.cond(tf.convert_to_tensor(self._bps_async_ready), lambda: tf.constant(False), initialise)
        super().apply(grads, trainable_variables)
        deltas = [tf.convert_to_tensor(v) - tf.convert_to_tensor(o) for v, o in zip(variables, old)]
        adopt(_transfer(deltas, names, None, "tf.async", "bps_async_push", asynchronous=True))

    def _bps_apply_accumulated(self, grads, variables, trainable_variables):
        """backward_passes_per_step > 1: sum gradients locally; every N-th call push_pull and apply."""
        acc = [self._bps_accumulators[self._get_variable_index(v)] for v in variables]
        count = self._bps_pass_count.assign_add(1)
        is_update = tf.equal(tf.math.floormod(tf.convert_to_tensor(count), self._bps_passes), 0)
        parent = super()

        def update():
            total = [None if g is None else _densify(g) + tf.cast(tf.convert_to_tensor(a), g.dtype)
                     for g, a in zip(grads, acc)]
            if self._bps_average_passes:
                total = [None if g is None else g / tf.cast(self._bps_passes, g.dtype) for g in total]
            if common.size() > 1:
                total = self._bps_reduce(total, variables)
            parent.apply(total, trainable_variables)
            for a in acc:
                a.assign(tf.zeros(a.shape, dtype=a.dtype))
            return tf.constant(True)

        def accumulate():
            for g, a in zip(grads, acc):
                if g is not None:
                    a.assign_add(tf.cast(_densify(g), a.dtype))
            return tf.constant(False)

        tf.cond(is_update, update, accumulate)


def DistributedOptimizer(optimizer, name=None, compression=Compression.none, op=Average,
                         backward_passes_per_step=1, device_dense="", device_sparse="", sparse_as_dense=True,
                         use_locking=False, asynchronous=None, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False):
    """Wrap a Keras 3 optimizer so that gradients are averaged over all workers before each update.

    Works with ``model.fit`` (``jit_compile=False``), ``optimizer.apply_gradients`` and
    ``optimizer.apply``, eager or in ``tf.function``. Returns a new optimizer of a subclass of
    ``optimizer``'s class, made from its config; a built optimizer's state is copied over.

    Args:
        optimizer: a ``keras.optimizers.Optimizer``.
        name: prefix of the gradients' tensor names (default ``DistributedOptimizer``); gradient of
            trainable variable ``i`` is ``<name>.Gradient.<i>``.
        compression: ``Compression.none`` or ``Compression.fp16`` (on the tensor), or a wire compressor
            (``Compression.onebit(error_feedback=True)``, ``.topk``, ...; docs/compression.md).
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: sum the gradients of this many calls locally, then push_pull the
            sum and update once (as ``byteps.torch`` and Horovod do; divide the loss by N for an
            average). The wrapped optimizer's ``iterations`` then counts updates.
        device_dense, device_sparse, sparse_as_dense, use_locking: accepted for compatibility.
        gradient_predivide_factor: Horovod's: gradients are divided by this before the sum and
            multiplied by ``factor / size()`` after it (``op=Average`` only).
        average_aggregated_gradients: with ``backward_passes_per_step > 1``, divide the locally
            summed gradients by the number of passes (Horovod's option; default: their sum).
        asynchronous: ``None`` follows the job (``BYTEPS_ENABLE_ASYNC``); ``True`` insists on it. In
            asynchronous mode each update is applied locally and its delta pushed; the worker then
            continues from the servers' latest parameters, starting from rank 0's (docs/async.md).
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"byteps.tensorflow.DistributedOptimizer needs a Keras 3 optimizer "
                        f"(keras.optimizers.Optimizer), got {type(optimizer).__name__}; legacy "
                        "tf.compat.v1.train optimizers are not supported (use DistributedGradientTape)")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    op = _resolve_op(None, op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is supported only with op=Average")
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {"__module__": base.__module__})
    new = cls.from_config(optimizer.get_config())
    new._bps_op = op
    new._bps_scale = (1.0 / gradient_predivide_factor, float(gradient_predivide_factor))
    new._bps_average_passes = bool(average_aggregated_gradients)
    new._bps_compression = compression
    new._bps_passes = int(backward_passes_per_step)
    job_async = common.is_initialized() and common.config().enable_async
    if asynchronous and not job_async:
        raise ValueError("asynchronous DistributedOptimizer needs BYTEPS_ENABLE_ASYNC=1 on every scheduler, "
                         "server and worker of the job (the servers must keep parameters instead of summing)")
    if job_async and int(backward_passes_per_step) != 1:
        raise ValueError("backward_passes_per_step > 1 is not supported in asynchronous mode")
    new._bps_async = bool(job_async and common.config().distributed and asynchronous is not False)
    new._bps_prefix = f"{name or 'DistributedOptimizer'}.Gradient."
    if optimizer.built:
        new.build(list(optimizer._trainable_variables))
        for mine, theirs in zip(new.variables, optimizer.variables):
            mine.assign(theirs)
    return new
