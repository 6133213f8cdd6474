"""Horovod's ``hvd.SyncBatchNormalization`` for Keras 3: batch normalization whose training statistics are
those of every worker's batch together, from one differentiable Sum allreduce of the per-channel sums,
sums of squares and counts (so batch sizes may differ; docs/compat.md). In inference, or in a job of one
worker, it is Keras's ``BatchNormalization``."""
import itertools

import keras
import tensorflow as tf

from byteps import common

from .collectives import allreduce
from .ops import Sum

_instances = itertools.count()  # construction order, the same on every worker: the allreduces' names


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Drop-in for ``keras.layers.BatchNormalization`` that normalizes over every worker's batch.

    Horovod's constructor: ``fused`` may be given as False or None (Keras 3 has no fused kernel; True is
    refused, as Horovod does). Every worker must build its SyncBatchNormalization layers in the same order
    (their allreduces are named by it) and call them in the same order.
    """

    def __init__(self, fused=False, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)
        self._bps_name = f"SyncBatchNormalization.{next(_instances)}"

    def _moments(self, inputs, mask):
        if not common.is_initialized() or common.size() == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        weights = tf.ones_like(inputs) if mask is None else tf.broadcast_to(
            tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
        local = tf.stack([tf.reduce_sum(inputs * weights, axes), tf.reduce_sum(tf.square(inputs) * weights, axes),
                          tf.reduce_sum(weights, axes)])
        # one name per layer and dtype: its statistics have the same shape at every call
        total = allreduce(local, op=Sum, name=f"{self._bps_name}.{inputs.dtype.name}")
        count = tf.maximum(total[2], 1.0)
        mean = total[0] / count
        variance = tf.maximum(total[1] / count - tf.square(mean), 0.0)
        return mean, variance
