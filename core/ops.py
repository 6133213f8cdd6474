"""One push_pull or broadcast in flight (:class:`Op`).

It lives apart from core/engine.py so that the engine's helpers can name it without importing the
engine: dependencies point one way, from the engine down.
"""
import threading
import time

from byteps.log import logger

from . import wire

Cmd = wire.Cmd

_done_lock = threading.Lock()


class Done:
    """An op's completion flag: ``threading.Event``'s ``is_set`` / ``set`` / ``wait``, with the (costly)
    event made only when someone waits before the op is done: a synchronous call that completes on its
    caller's thread never needs one."""

    __slots__ = ("_set", "_event")

    def __init__(self):
        self._set = False
        self._event = None

    def is_set(self):
        return self._set

    def set(self):
        with _done_lock:
            self._set = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout=None):
        if self._set:
            return True
        with _done_lock:
            if self._set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


class Op:
    """One push_pull or broadcast of one tensor, in flight."""

    __slots__ = ("name", "buf", "dtype", "shape", "cmd", "root", "priority", "spec", "tkey", "error", "done",
                 "started", "callbacks", "codec", "native_id", "pset", "divisor", "divided", "partition_bytes")

    def __init__(self, name, buf, dtype, shape, cmd=Cmd.PUSHPULL, root=0, priority=0, pset=None):
        self.name = name
        self.buf = buf              # flat uint8 numpy view of the tensor's memory: input and output
        self.dtype = dtype
        self.shape = tuple(shape)
        self.cmd = cmd
        self.root = root
        self.priority = priority
        # a process set's members, (set id, sorted global ranks), or None for every rank: its tensors have
        # keys of their own, every member pushes itself (no local reduce), and servers sum the members only
        self.pset = pset
        self.spec = (self.shape, dtype, int(cmd), pset)
        self.tkey = None
        self.error = None
        self.done = Done()
        self.started = time.monotonic()
        self.callbacks = []
        self.codec = None           # byteps.compression.WireCompressor for partitions sent over the network
        self.native_id = None       # its id in the native data plane (core/pipeline/bps_worker.h), if it runs there
        self.divisor = 1            # an average: the sum is divided by this (float push_pulls; common.submit)
        self.divided = False        # the native core divided each partition on its way into ``buf``
        # the job's partition size when it was submitted (Engine.expect_model); a tensor is cut at its first op
        self.partition_bytes = None

    def fail(self, error):
        if self.error is None:
            self.error = error
        self._finish()

    def _finish(self):
        self.done.set()
        for cb in self.callbacks:
            try:
                cb(self)
            except Exception:  # a callback must not kill the engine thread
                logger.exception("completion callback of %r failed", self.name)
