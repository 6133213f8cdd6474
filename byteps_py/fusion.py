"""Balanced fusion buffers without negotiation (Herring §III.1-2) over byteps push_pull.

:class:`FusedPushPull` copies tensors into a few fusion buffers and push_pulls the buffers; with
``BYTEPS_PLACEMENT=balanced`` every buffer is cut over the servers in the optimal k/n proportions
(docs/placement.md). The first step push_pulls each tensor on its own and records the order they
were handed over; rank 0's order is then broadcast once, and every later step copies the tensors
into fixed places of that layout and push_pulls each buffer, in layout order, once it is complete.
The tensors are byte views, as in :func:`byteps.common.submit`, and results are sums.
"""
import numpy as np

from . import common
from .core import dtypes
from .core._reduce import aligned_empty, copy_into


class FusionLayout:
    """Where each tensor's bytes live: buffers and (buffer, buffer offset, tensor offset, length) runs.

    Args:
        entries: ``(name, nbytes, dtype code)`` in fusion order.
        buffer_bytes: size of every buffer but the last of each dtype (rounded down to whole elements).
    """

    def __init__(self, entries, buffer_bytes):
        self.buffers = []   # (dtype code, nbytes)
        self.runs = {}      # name -> [(buffer index, offset in buffer, offset in tensor, length)]
        open_buffer = {}    # dtype -> (buffer index, bytes used)
        for name, nbytes, dtype in entries:
            size = dtypes.itemsize(dtype)
            cap = max(size, buffer_bytes // size * size)
            runs = self.runs[name] = []
            done = 0
            while done < nbytes or (nbytes == 0 and not runs):
                index, used = open_buffer.get(dtype, (None, cap))
                if used >= cap:
                    index, used = len(self.buffers), 0
                    self.buffers.append([dtype, 0])
                take = min(cap - used, nbytes - done)
                runs.append((index, used, done, take))
                self.buffers[index][1] += take
                open_buffer[dtype] = (index, used + take)
                done += take
        self.buffers = [tuple(b) for b in self.buffers]
        self.members = [set() for _ in self.buffers]  # buffer -> names with bytes in it
        for name, runs in self.runs.items():
            for b, *_ in runs:
                self.members[b].add(name)


class FusedPushPull:
    """push_pull a fixed set of tensors every step through balanced fusion buffers.

    Usage, once per step (the same tensors every step, in any order)::

        fused = FusedPushPull("grads")
        for name, view, dtype in gradients_as_they_become_ready():
            fused.add(name, view, dtype)     # view: writable flat uint8 numpy view of the tensor
        fused.synchronize()                  # every view now holds the sum over all workers

    Args:
        prefix: names of the fusion buffers on the wire (one per FusedPushPull of a job).
        buffer_bytes: fusion buffer size; default ``BYTEPS_PARTITION_BYTES``, so each buffer is one
            partition, which the balanced placement cuts in the optimal per-server proportions.
    """

    def __init__(self, prefix="fused", buffer_bytes=None):
        self.prefix = prefix
        self.buffer_bytes = buffer_bytes
        self.layout = None
        self.step = 0
        self._order = []        # first step: names in the order they were handed over
        self._specs = {}        # name -> (nbytes, dtype)
        self._views = {}        # this step: name -> view
        self._handles = []      # this step: (handle, name or buffer index)
        self._filled = []       # per buffer: names whose bytes are in
        self._next = 0          # first buffer not yet submitted this step
        self._storage = []      # per buffer: aligned byte array

    def add(self, name, view, dtype):
        """Hand over one tensor for this step (its bytes are read now in fused steps)."""
        if view.dtype != np.uint8 or view.ndim != 1:
            raise ValueError(f"tensor {name!r}: FusedPushPull takes flat uint8 views, got {view.dtype}{view.shape}")
        if name in self._views:
            raise ValueError(f"tensor {name!r} was handed to FusedPushPull {self.prefix!r} twice in one step")
        self._views[name] = view
        if self.layout is None:
            if self.step > 0 or name in self._specs:
                raise ValueError(f"tensor {name!r} was handed to FusedPushPull {self.prefix!r} twice in one step")
            self._specs[name] = (view.nbytes, dtype)
            self._order.append(name)
            return
        spec = self._specs.get(name)
        if spec != (view.nbytes, dtype):
            want = "not part of the fused set" if spec is None else f"{spec[0]} bytes of {dtypes.name(spec[1])}"
            raise ValueError(f"tensor {name!r} ({view.nbytes} bytes of {dtypes.name(dtype)}) does not match the "
                             f"fusion layout of {self.prefix!r} ({want}); the set of tensors is fixed after step 1")
        for b, boff, toff, length in self.layout.runs[name]:
            copy_into(self._storage[b][boff:boff + length], view[toff:toff + length])
            self._filled[b].add(name)
        # submit complete buffers in layout order only (the same order on every worker)
        while self._next < len(self.layout.buffers) and \
                len(self._filled[self._next]) == len(self.layout.members[self._next]):
            b = self._next
            dtype, nbytes = self.layout.buffers[b]
            self._handles.append((common.submit(f"{self.prefix}.buffer.{b}", self._storage[b], dtype,
                                                (nbytes // dtypes.itemsize(dtype),)), b))
            self._next += 1

    def synchronize(self):
        """Wait for this step's push_pulls; every handed-over view then holds its sum."""
        first = self.layout is None
        if not first and len(self._views) != len(self._specs):
            missing = sorted(set(self._specs) - set(self._views))
            raise ValueError(f"FusedPushPull {self.prefix!r}: tensors {missing[:5]} were not handed over this step")
        if first:  # unfused, in name order: the same on every worker
            for name in sorted(self._views):
                nbytes, dtype = self._specs[name]
                self._handles.append((common.submit(f"{self.prefix}.first.{name}", self._views[name], dtype,
                                                    (nbytes // dtypes.itemsize(dtype),)), name))
        try:
            for handle, _ in self._handles:
                common.synchronize(handle)
            if not first:
                for name, view in self._views.items():
                    for b, boff, toff, length in self.layout.runs[name]:
                        copy_into(view[toff:toff + length], self._storage[b][boff:boff + length])
        finally:
            self._handles = []
            self._views = {}
            self._filled = [set() for _ in self._filled]
            self._next = 0
        if first:
            self._agree_on_order()
        self.step += 1

    def _agree_on_order(self):
        """Broadcast rank 0's first-step order once and lay the buffers out in it (no later negotiation)."""
        names = sorted(self._specs)
        index = {n: i for i, n in enumerate(names)}
        order = np.array([index[n] for n in self._order], dtype=np.int32)
        common.synchronize(common.submit(f"{self.prefix}.order", order.view(np.uint8), dtypes.INT32,
                                         order.shape, broadcast_root=0))
        if sorted(order.tolist()) != list(range(len(names))):
            raise ValueError(f"FusedPushPull {self.prefix!r}: rank 0's tensor order is not a permutation of this "
                             "worker's tensors (different tensor sets on different workers?)")
        if self.buffer_bytes is None:
            self.buffer_bytes = common.config().partition_bytes
        self.layout = FusionLayout([(names[i], *self._specs[names[i]]) for i in order.tolist()], self.buffer_bytes)
        self._storage = [aligned_empty(max(nbytes, 1))[:nbytes] for _, nbytes in self.layout.buffers]
        self._filled = [set() for _ in self.layout.buffers]
