"""``byteps.tensorflow.distribute.MirroredStrategy``: BytePS's strategy for ``tf.distribute`` users.

TensorFlow's MirroredStrategy over this process's devices (CPU included), whose cross-device
reductions sum this process's replicas and then average over the workers, one push_pull per tensor
named per reduction site at trace time (``MirroredStrategy.<n>.<i>``). Keras divides each replica's
loss by the local replica count, so the result is the whole job's mean gradient. Broadcast the
initial variables once (``callbacks.BroadcastGlobalVariablesCallback``); feed equal batch sizes."""
import itertools

import tensorflow as tf
from tensorflow.python.distribute import values as _values

from byteps import common

from ..ops import Average, push_pull_group

__all__ = ["MirroredStrategy", "PushPullCrossDeviceOps"]


class PushPullCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Sum over this process's replicas, then average over the workers (byteps push_pull)."""

    def __init__(self, reduce_to_device=None, name="MirroredStrategy"):
        super().__init__(reduce_to_device=reduce_to_device)
        self._bps_name = name
        self._sites = itertools.count()  # reduction sites, numbered at trace time

    @property
    def _num_between_graph_workers(self):
        # more than one: TensorFlow must not skip the reduction when this process has a single replica
        return max(2, common.size()) if common.is_initialized() else 1

    def _across_workers(self, reduced):
        """Average locally reduced values over the workers; each is a tensor or a Mirrored value."""
        site = next(self._sites)
        firsts = [r.values[0] if isinstance(r, _values.Mirrored) else r for r in reduced]
        if common.size() > 1:
            firsts = push_pull_group(firsts, [f"{self._bps_name}.{site}.{i}" for i in range(len(firsts))],
                                     op=Average)
        out = []
        for r, v in zip(reduced, firsts):
            if isinstance(r, _values.Mirrored):  # one copy per destination device
                copies = []
                for d in r.values:
                    with tf.device(d.device):
                        copies.append(tf.identity(v))
                out.append(_values.Mirrored(tuple(copies)))
            else:
                out.append(v)
        return out

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        local = super().reduce_implementation(reduce_op, per_replica_value, destinations, options)
        return self._across_workers([local])[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        local = super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
        return self._across_workers(list(local))


class MirroredStrategy(tf.distribute.MirroredStrategy):
    """BytePS's ``MirroredStrategy(devices=None, cross_device_ops=None)``: TensorFlow's, with reductions
    that reach every worker (:class:`PushPullCrossDeviceOps`). Call ``byteps.tensorflow.init()`` first."""

    def __init__(self, devices=None, cross_device_ops=None):
        if not common.is_initialized():
            common.init()
        super().__init__(devices=devices, cross_device_ops=cross_device_ops or PushPullCrossDeviceOps())
