"""The topology plan's GPU stages inside a job (``BYTEPS_LOCAL_STRATEGY=topology``, CUDA tensors).

With ``topology``, host tensors keep the native local reduce with the plan's owners (core/local.py).
CUDA tensors take the executor of the machine's :func:`byteps.topology.plan`,
:class:`~byteps.core.gpu_stages.GpuExecutor` (NCCL and pinned staging), when the GPU stages are
usable here (:func:`cuda_reason` is None; the torch plugin then hands CUDA tensors over without a
host copy); elsewhere they take the native copy stages (COPYD2H / COPYH2D) like any CUDA tensor.
Broadcasts, asynchronous exchanges and process sets keep the native path.

One thread per worker process (``byteps-local-exec``) runs ``executor.push_pull`` for the ops in
**submission order**. The executor's barriers (topology/localsync.py) need every local process
to handle the same tensor at the same time, exactly as NCCL needs every rank to issue collectives
in the same order: a machine's processes must submit their CUDA push_pulls in the same order
(gradient hooks of one model do). A process that submits another tensor in that slot fails that
operation on every local process with a ``TensorMismatchError`` naming the local ranks and what
each has (bytes, dtype, tensor key); one that never submits it makes the others fail with a
``BytePSTimeoutError`` naming it. Since each operation finishes its network step before the next
starts, every *worker* must also submit in the same order (two machines working on different
tensors first would wait for each other until ``BYTEPS_TIMEOUT``).

The executor calls its ``network(view, start, stop, nic)`` hook once per element range of the
machine's sum that this process owns; the hook hands the range to the engine
(:meth:`~byteps.core.engine.Engine.push_range`, through the engine's inbox and wake pipe) and
returns a callable that waits for it, so only this thread blocks; the engine thread keeps its
heartbeats. The engine cuts the range into partitions by the placement and hands them to the
native core (credit and priorities as for any partition), without its own local reduce: exactly
one process per machine pushes each range, and servers expect one push per machine and key, as
with ``owners``.

Wire keys: partition ``j`` of range ``i`` of tensor key ``t`` is ``t << 32 | i << 16 | j``.
``i`` numbers the ranges of the whole tensor in order: a tensor is aggregated in chunks of
``CHUNK_PARTITIONS`` partitions (the executor's buffers have a fixed size), and each chunk is cut
into ranges by the plan: ``local_size`` slices for ``cpu_assisted`` / ``reduce_scatter``, one range
per partition for ``reduce_broadcast``. ``j`` is the placement's index of the piece within the
range (its server is ``j``'s server for the key ``t << 16 | i``). All of it is a function of the
plan's kind of cut, the element count and ``BYTEPS_PARTITION_BYTES``, so identical machines agree;
to make sure, the tensor is declared to the scheduler with that cut in its operation
(:func:`layout`'s ``kind``), and workers whose cuts differ get the scheduler's mismatch error
naming every rank's, instead of summing different ranges under one key.

Buffers: the executor's memfd arenas (never in /dev/shm); a colocated server is handed a
descriptor of the executor's buffer itself (LocalGroup.locate), so the range is not copied again.
"""
import collections
import dataclasses
import functools
import hashlib
import threading
import time

import numpy as np

from byteps.errors import BytePSError, BytePSTimeoutError, TensorMismatchError
from byteps.log import logger

from . import dtypes
from .ops import Cmd, RangeOp

#: a tensor is aggregated in chunks of this many partitions (BYTEPS_PARTITION_BYTES each): the
#: executor's buffers bound the memory used
CHUNK_PARTITIONS = 16
#: wire key index = range index << RANGE_BITS | piece index
RANGE_BITS = 16


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one tensor is cut for the executor: chunks, and the ranges of each chunk."""

    count: int
    #: (first element, end element, index of the chunk's first range, ((start, stop, owner local rank), ...))
    #: with range bounds relative to the chunk
    chunks: tuple
    kind: str  #: the operation declared to the scheduler; equal kinds mean equal cuts


def layout(plan, count, itemsize, partition_bytes):
    """The :class:`Layout` of a tensor of ``count`` elements under ``plan`` (see the module docstring)."""
    from byteps.topology.strategy import partition_bounds

    per_part = max(1, partition_bytes // itemsize)
    per_chunk = CHUNK_PARTITIONS * per_part
    if plan.strategy == "reduce_broadcast":
        cut = f"partitions of {per_part} elements"
    elif plan.strategy == "none" or plan.local_size == 1:
        cut = "whole"
    else:
        cut = f"{plan.local_size} slices"
    chunks, first = [], 0
    for c0 in range(0, max(count, 1), per_chunk):
        n = min(count, c0 + per_chunk) - c0
        if plan.strategy == "reduce_broadcast":
            ranges = tuple((a, b, plan.root_for(i)) for i, (a, b) in enumerate(partition_bounds(n, itemsize,
                                                                                               partition_bytes)))
        elif cut == "whole":
            ranges = ((0, n, 0),)
        else:
            ranges = tuple((a, b, r) for r, (a, b) in enumerate(plan.reduce_ranges(n)))
        chunks.append((c0, c0 + n, first, ranges))
        first += len(ranges)
    if first > 1 << RANGE_BITS:
        raise BytePSError(f"a tensor of {count} elements needs {first} local ranges, more than the "
                          f"{1 << RANGE_BITS} its wire keys can number; raise BYTEPS_PARTITION_BYTES")
    return Layout(count, tuple(chunks), f"push_pull over local ranges ({cut}, chunks of {per_chunk} elements)")


def machine_plan(local_size, env=None):
    """This machine's plan for ``local_size`` processes (BYTEPS_TOPOLOGY_FILE, the overrides, or
    detection). More processes than GPUs: the CPU analogue's plan (processes by NUMA node)."""
    import byteps.topology as topology

    machine = topology.resolve_machine(env=env)
    if machine.gpus and local_size > len(machine.gpus):
        machine = dataclasses.replace(machine, gpus=(), links=tuple(ln for ln in machine.links if ln.kind == "qpi"))
    return topology.plan(machine=machine, local_size=local_size, env=env)


def cuda_reason(plan):
    """None when CUDA tensors can take the GPU stages on this machine, else why not."""
    if plan.device != "gpu":
        return "this machine's topology plan has no GPUs (the CPU analogue)"
    from .gpu import unavailable_reason
    from .gpu_stages import communicators

    return unavailable_reason(need_nccl=bool(communicators(plan)), min_devices=max(plan.devices) + 1)


def token(cfg, book):
    """Names the machine's executors: shared by its processes, unique to the job and epoch (a job
    that shuts down and init()s again gets new names, so no datagram reaches a stale group)."""
    ident = f"{cfg.job_id}|{cfg.root_uri}|{cfg.root_port}|{book.get('epoch', 0)}".encode()
    return f"{hashlib.sha1(ident).hexdigest()[:16]}-w{cfg.worker_id}"


def start(engine):
    """The engine's LocalExec when this process hands CUDA tensors to the topology plan's GPU stages,
    else None (host tensors take the native local reduce, with the plan's owners: core/local.py).

    Needs the engine's local reduce to be on (several processes on this machine, every machine
    reducing locally, not asynchronous): the servers then expect one push per machine."""
    cfg = engine.cfg
    if getattr(cfg, "local_strategy", "owners") != "topology":
        return None
    if engine.local is None:
        if cfg.local_size > 1:
            logger.warning("BYTEPS_LOCAL_STRATEGY=topology has no effect: this job does not reduce locally "
                           "(BYTEPS_LOCAL_REDUCE=0, BYTEPS_PIPELINE=-local_reduce, asynchronous training, or a "
                           "machine that does not)")
        return None
    from . import stages

    plan = engine.local.topology or machine_plan(cfg.local_size)
    reason = cuda_reason(plan)
    if reason is not None:
        logger.info("CUDA tensors take the native copy stages, not the plan's GPU stages: %s", reason)
        return None
    ex = LocalExec(engine, plan, token(cfg, engine.book))
    logger.info("pipeline of a CUDA range on the topology path: %s (owner), %s (other local ranks)",
                stages.describe(stages.executor_stage_list(plan, True)),
                stages.describe(stages.executor_stage_list(plan, False)))
    ex.start()
    return ex


def takes_cuda(engine):
    """True when this process hands CUDA tensors to the GPU stages (the torch plugin asks)."""
    return getattr(engine, "_local_exec", None) is not None


def cuda_device(engine):
    """The CUDA device ordinal this process's GPU stages drive (its tensors must be there)."""
    from .gpu_stages import cuda_ordinal

    return cuda_ordinal(engine._local_exec.plan.devices[engine.cfg.local_rank])


class LocalExec:
    """The ``byteps-local-exec`` thread of one worker process and its GPU executor."""

    def __init__(self, engine, plan, token):
        cfg = engine.cfg
        self.engine, self.plan, self.token = engine, plan, token
        self.rank = cfg.local_rank
        self.partition_bytes = cfg.partition_bytes
        self.chunk_bytes = CHUNK_PARTITIONS * cfg.partition_bytes
        # a local wait outlasts the engine's BYTEPS_TIMEOUT, so that a peer whose range timed out in
        # the engine reports it in the next barrier before we give up on that peer
        self.timeout = cfg.timeout + max(2.0, 0.25 * cfg.timeout)
        self.gpu = None
        self.stats = collections.Counter()  #: ops, chunks, ranges pushed (tests read it)
        self._cv = threading.Condition()
        self._queue = collections.deque()
        self._layouts = {}          # op -> Layout, while the op is queued or running here
        self._stopped = False
        self._broken = None         # the error after which this process is out of step with its peers
        self._net_failure = None    # the error our own network step raised in the current operation
        self._thread = threading.Thread(target=self._run, name="byteps-local-exec", daemon=True)

    # ------------------------------------------------------------- engine / training-thread side

    def start(self):
        self._thread.start()

    def takes(self, op):
        """CUDA push_pulls go through the executor; host tensors, broadcasts, async exchanges, ranges
        and a process set's push_pulls (its members push themselves) do not."""
        from .gpu import DeviceArray

        return op.cmd == Cmd.PUSHPULL and isinstance(op.buf, DeviceArray) and op.pset is None

    def enqueue(self, op):
        """Queue ``op`` in submission order (called by Engine.submit on the training thread)."""
        isz = dtypes.itemsize(op.dtype)
        lay = layout(self.plan, op.buf.nbytes // isz, isz, self.partition_bytes)
        with self._cv:
            if self._stopped:
                raise BytePSError("byteps is shutting down")
            self._layouts[op] = lay
            self._queue.append(op)
            self._cv.notify_all()

    def owns(self, op):
        return op in self._layouts

    def kind(self, op):
        """The operation declared to the scheduler for ``op`` (its cut into ranges)."""
        return self._layouts[op].kind

    def keyed(self, op, tkey):
        """The scheduler's key for ``op`` arrived (engine thread): the executor may run it."""
        with self._cv:
            op.tkey = tkey
            self._cv.notify_all()

    def close(self):
        """Stop the thread (engine shutdown); it closes the executors. Bounded: a thread stuck in a
        barrier is left to its time-out, and the kernel frees its arenas at exit."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    # ------------------------------------------------------------- the thread

    def _run(self):
        from .threads import name_native

        name_native()
        try:
            while (op := self._next()) is not None:
                self._handle(op)
        finally:
            if self.gpu is not None:
                try:
                    self.gpu.close()
                except Exception:
                    logger.exception("closing the local executor failed")
            with self._cv:
                left, self._queue = list(self._queue), collections.deque()
            for op in left:
                op.fail(self.engine.failure or BytePSError(f"push_pull of tensor {op.name!r}: byteps shut down"))

    def _next(self):
        with self._cv:
            while not self._queue:
                if self._stopped:
                    return None
                self._cv.wait(0.5)
            return self._queue.popleft()

    def _handle(self, op):
        try:
            # the key comes from the scheduler through the engine; a declaration that fails or times
            # out fails the op there, the same on every local process (they all declared it)
            with self._cv:
                while op.tkey is None and not op.done.is_set() and not self._stopped \
                        and self.engine.failure is None:
                    self._cv.wait(0.2)
            if op.done.is_set():
                return
            if self.engine.failure is not None or self._stopped:
                op.fail(self.engine.failure or BytePSError(f"push_pull of tensor {op.name!r}: byteps shut down"))
                return
            if self._broken is not None:
                op.fail(BytePSError(f"push_pull of tensor {op.name!r}: this machine's local executor stopped after "
                                    f"an earlier failure ({type(self._broken).__name__}: {self._broken})"))
                return
            self._net_failure = None
            try:
                self._execute(op, self._layouts[op])
            except TensorMismatchError as e:  # from the first barrier: every local process raised it
                op.fail(TensorMismatchError(f"push_pull of tensor {op.name!r}: {e} (a machine's processes must "
                                            "submit their push_pulls in the same order: BYTEPS_LOCAL_STRATEGY="
                                            "topology)"))
            except Exception as e:
                from byteps.topology.localsync import LocalPeerError

                # a failure every local process learned of in the same barrier keeps them in step;
                # anything else (a time-out waiting for a peer) leaves this process out of step
                if e is self._net_failure:  # the engine's error for our range: it names the tensor already
                    op.fail(e)
                    return
                if not isinstance(e, LocalPeerError):
                    self._broken = e
                    logger.error("local executor: %s; later push_pulls on this process fail", e)
                op.fail(_named(op, e))
            else:
                self.stats["ops"] += 1
                op._finish()
        finally:
            self._layouts.pop(op, None)

    def _execute(self, op, lay):
        if lay.count == 0:
            return  # nothing to sum: no process pushes anything, on any machine
        isz = dtypes.itemsize(op.dtype)
        if self.gpu is None:  # built on first use: the same op on every local process
            from .gpu_stages import GpuExecutor

            self.gpu = GpuExecutor(self.plan, self.rank, self.token + "-gpu", self.chunk_bytes, self.timeout,
                                   self.partition_bytes)
        for c0, c1, first, ranges in lay.chunks:
            hook = functools.partial(self._network, op, self.gpu.group, first, ranges)
            self.stats["chunks"] += 1
            # the first chunk waits for the producer (the event the plugin recorded at submission);
            # the later ones run after it on the same stream
            first_chunk = c0 == 0
            piece = dataclasses.replace(op.buf, ptr=op.buf.ptr + c0 * isz, nbytes=(c1 - c0) * isz, count=c1 - c0,
                                        stream=op.buf.stream if first_chunk else None,
                                        ready_event=op.buf.ready_event if first_chunk else None)
            self.gpu.push_pull(piece, network=hook, tag=op.tkey)

    def _network(self, op, group, first, ranges, view, start, stop, nic):
        """The executor's hook: push range [start, stop) of the machine's sum, pull the global sum into
        ``view``; returns the wait (the executor calls it after issuing all its ranges)."""
        for k, (a, b, owner) in enumerate(ranges):
            if (a, b) == (start, stop):
                break
        else:
            raise BytePSError(f"push_pull of tensor {op.name!r}: the executor produced range [{start}, {stop}), "
                              f"which is not in the layout {[r[:2] for r in ranges]}")
        if owner != self.rank:
            raise BytePSError(f"push_pull of tensor {op.name!r}: range [{start}, {stop}) belongs to local rank "
                              f"{owner}, not {self.rank}")
        data = view.reshape(-1).view(np.uint8)
        rop = RangeOp(op.name, data, op.dtype, (stop - start,), priority=op.priority)
        rop.tkey, rop.range_index = op.tkey, first + k
        rop.place_key = (op.tkey << RANGE_BITS) | rop.range_index
        rop.shared = group.locate(data)
        rop.codec = op.codec
        self.engine.push_range(rop)
        self.stats["ranges"] += 1
        return functools.partial(self._wait, rop)

    def _wait(self, rop):
        # the engine fails a range within BYTEPS_TIMEOUT (naming the servers it waited for); this
        # bound only guards against a bug
        limit = self.engine.cfg.timeout + 30
        began = time.monotonic()
        while not rop.done.wait(0.2):
            if self.engine.failure is not None:
                raise self._failed(self.engine.failure)
            if self._stopped:  # shutdown() while this push_pull was still running
                raise self._failed(BytePSError(f"push_pull of tensor {rop.name!r}: byteps shut down"))
            if time.monotonic() - began > limit:
                raise self._failed(BytePSTimeoutError(f"push_pull of tensor {rop.name!r}: range {rop.range_index} "
                                                      f"waited {limit:g} s for the engine"))
        if rop.error is not None:
            raise self._failed(rop.error)

    def _failed(self, error):
        """Remember the first error of our network step: the executor reports it to every local
        process in its next barrier and then raises it here, so we stay in step with them."""
        if self._net_failure is None:
            self._net_failure = error
        return error


def _named(op, error):
    """``error`` with the tensor's name in front, of the same type where that type allows."""
    from byteps.topology.localsync import LocalPeerError

    text = f"push_pull of tensor {op.name!r} (BYTEPS_LOCAL_STRATEGY=topology): {error}"
    if isinstance(error, LocalPeerError):
        return LocalPeerError(text, error.errors)
    if isinstance(error, BytePSError):
        try:
            return type(error)(text)
        except TypeError:
            pass
    return BytePSError(f"{text} ({type(error).__name__})")
