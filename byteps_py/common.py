"""Framework-agnostic worker API: init/shutdown, ranks, asynchronous push_pull and broadcast on raw buffers.

The plugins (``byteps.torch``, ...) only translate framework tensors into a flat byte view
plus a dtype code and call :func:`submit`; every rule about handles, names and waiting lives here.
"""
import atexit
import itertools
import os
import threading
import time

from . import compression as _compression, config as bps_config, timeline
from .core import _reduce, dtypes
from .core.ops import Cmd, Op
from .errors import BytePSError, BytePSTimeoutError, NotInitializedError
from .log import logger, setup as setup_logging

_lock = threading.RLock()
_job = None
_exit_notice = None   # (config) of the last distributed init, for the EXIT message at process exit
_atexit_registered = False


class _Job:
    def __init__(self, cfg, engine):
        self.cfg = cfg
        self.engine = engine
        self.rank = engine.rank if engine else 0
        self.size = engine.size if engine else 1
        self.model_bytes = 0  # the largest model an optimizer declared (expect_model)
        self.handles = {}
        self.next_handle = itertools.count(1)
        self.inflight = {}          # name -> the op in flight under it
        self.inflight_lock = threading.Lock()
        self.noname = itertools.count()
        self.scoped_noname = {}   # process set id -> its own count of unnamed calls (auto_name)
        # one barrier at a time per process, all named alike: a rank whose last barrier failed meets the
        # others' next one (a number per call would put the ranks out of step for good)
        self.barrier_lock = threading.Lock()
        # BYTEPS_COMPRESSOR & co. are read at init() like every other variable (not per call: seven
        # environment look-ups cost more than the rest of a small push_pull's submission)
        self.default_codec = _compression.default_codec()


def _require():
    job = _job
    if job is None:
        raise NotInitializedError("byteps is not initialized: call byteps init() first (or it was shut down)")
    return job


def init(lazy=False):
    """Join the job described by the environment (DMLC_*, BYTEPS_*; see docs/env.md).

    Blocks until the scheduler has every node (bounded by BYTEPS_TIMEOUT). Calling it again while
    initialized does nothing; after :func:`shutdown` it joins again. ``lazy`` is accepted for
    BytePS compatibility and ignored: start-up is always eager, so errors surface here.
    """
    global _job, _exit_notice, _atexit_registered
    with _lock:
        if _job is not None:
            return
        cfg = bps_config.load()
        setup_logging("worker", f"{cfg.worker_id}.{cfg.local_rank}")
        engine = None
        if cfg.distributed:
            from byteps.core.engine import Engine

            engine = Engine(cfg)
            engine.start()
            _exit_notice = cfg
        # the engine's config carries the partition size and credit agreed at start (byteps/autotune.py)
        _job = _Job(engine.cfg if engine else cfg, engine)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        logger.info("initialized: rank %d of %d (local %d of %d)", _job.rank, _job.size, cfg.local_rank,
                    cfg.local_size)


def shutdown():
    """Leave the job: a collective over every worker, bounded by BYTEPS_TIMEOUT. Safe to call twice."""
    global _job
    with _lock:
        job = _job
        if job is None:
            return
        _job = None
        engine = job.engine
        if engine is None:
            return
        try:
            if engine.failure is None:
                released = engine.request("leave")
                if not released.wait(job.cfg.timeout):
                    logger.warning("shutdown() waited %g s (BYTEPS_TIMEOUT) for the other workers to shut down",
                                   job.cfg.timeout)
        finally:
            engine.stop()


def mark_step():
    """Mark the end of a training step on the job timeline (docs/timeline.md); nothing when it is off.

    The optimizers call it after each step; call it yourself in a loop that uses push_pull directly.
    """
    timeline.mark_step()


def start_timeline(path):
    """Horovod's ``start_timeline``: record the job timeline from now on; the scheduler writes ``path``
    (unless BYTEPS_TIMELINE names a file already) when the job ends and at each ``stop_timeline()``."""
    job = _require()
    if job.engine is None:
        raise ValueError("start_timeline() needs a distributed job: a single process has no servers to trace")
    if not job.engine.request("timeline", os.path.abspath(path)).wait(job.cfg.timeout):
        raise BytePSTimeoutError(f"start_timeline() waited {job.cfg.timeout:g} s (BYTEPS_TIMEOUT) for the engine")


def stop_timeline():
    """Horovod's ``stop_timeline``: stop recording on this worker and send what it recorded."""
    timeline.stop()


def _at_exit():
    try:
        shutdown()
    finally:
        if _exit_notice is not None:
            _notify_exit(_exit_notice)


def _notify_exit(cfg):
    """Tell the scheduler this worker process is exiting, so the job can end when all have."""
    import zmq

    from byteps.core import auth, wire

    body = {"worker_id": cfg.worker_id, "local_rank": cfg.local_rank, "pid": os.getpid()}
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        identity = auth.new_identity()
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(cfg.scheduler_endpoint)
        secret = auth.job_secret()
        if secret is not None:  # prove we belong to the job (bounded: the process is exiting)
            knock = auth.Knock(secret, identity)
            sock.send_multipart(wire.control(wire.Cmd.HELLO, body=knock.hello()))
            if not sock.poll(2000):
                logger.warning("the scheduler did not answer this worker's exit notice")
                return
            header, reply = sock.recv_multipart()
            try:
                body["auth"] = knock.answer(wire.decode(reply), "the scheduler")
            except auth.AuthError as e:
                logger.warning("%s", e)
                return
        sock.send_multipart(wire.control(wire.Cmd.EXIT, body=body))
        sock.close(linger=2000)
    finally:
        ctx.destroy(linger=0)


def is_initialized():
    return _job is not None


def rank():
    return _require().rank


def size():
    return _require().size


def local_rank():
    return _require().cfg.local_rank


def local_size():
    return _require().cfg.local_size


def config():
    """The validated :class:`byteps.config.Config` of this process."""
    return _require().cfg


def expect_model(model_bytes):
    """Say that each training step pushes ``model_bytes`` of gradients (``DistributedOptimizer`` and
    ``DistributedDataParallel`` call it). The job's partition size is chosen again for a step of that
    size (docs/autotune.md); tensors first used afterwards are cut to it. Every rank must make the same
    calls at the same points of its program. The largest model declared so far counts; with
    BYTEPS_PARTITION_BYTES set nothing changes."""
    job = _require()
    if job.engine is None or model_bytes <= job.model_bytes:
        return
    job.model_bytes = int(model_bytes)
    job.engine.expect_model(job.model_bytes)


def tuning():
    """The partition size and credit this worker uses, and why (docs/autotune.md): a dict with
    ``partition_bytes``, ``credit``, ``source`` ("probe", "env", "default", or "local" for a job of one
    process, which sends nothing and keeps the configuration's values), ``text`` (the line logged at
    INFO), and the ``bandwidth_Bps`` and ``rtt_s`` its credit came from (None if not measured)."""
    job = _require()
    if job.engine is not None and job.engine.tuning is not None:
        return job.engine.tuning._asdict()
    cfg = job.cfg
    return {"partition_bytes": cfg.partition_bytes, "credit": cfg.scheduling_credit, "source": "local",
            "text": "a job of one process: nothing crosses a network", "bandwidth_Bps": None, "rtt_s": None}


def auto_name(prefix, scope=0):
    """A name for an unnamed call: unique per call, identical on every worker calling in the same order.

    ``scope``: a process set's id; its calls are numbered apart, since only its members make them."""
    job = _require()
    if not scope:
        return f"{prefix}.noname.{next(job.noname)}"
    return f"{prefix}.set{scope}.noname.{next(job.scoped_noname.setdefault(scope, itertools.count()))}"


def sync_name(prefix, dtype, shape):
    """The name of an unnamed *synchronous* call (submitted and waited for by the same call).

    One name per (prefix, dtype, shape), so every later call reuses the tensor's key, stores and
    staging instead of declaring a new one (a round trip and fresh buffers). Safe because a synchronous
    call is over before the caller's next one starts, so every worker's n-th call of that shape meets
    the others' n-th call. If another thread has one in flight, the call gets an :func:`auto_name`.
    """
    job = _require()
    name = f"{prefix}.sync.{dtype}.{'x'.join(str(d) for d in shape) or 'scalar'}"
    return auto_name(prefix) if name in job.inflight else name


def submit(name, buf, dtype, shape, broadcast_root=None, priority=0, finalize=None, asynchronous=False,
           compression=None, sync=False, process_set=None, average_by=1):
    """Start a push_pull (or, with ``broadcast_root``, a broadcast) of a flat byte buffer, in place.

    Args:
        name: the tensor's name, the same on every worker.
        buf: a writable, C-contiguous uint8 numpy view of the tensor's memory (input and output), or a
            CUDA tensor's :class:`byteps.core.device_buffer.DeviceBuffer`.
        dtype: a code from :mod:`byteps.core.dtypes`.
        shape: the tensor's shape (compared across workers).
        broadcast_root: None for a sum, or the rank whose data every worker receives.
        priority: scheduling priority (larger first); used by the pipeline.
        finalize: called with no arguments on the caller's thread by :func:`synchronize`; its
            result is what :func:`synchronize` returns.
        average_by: a float push_pull's average: its sum divided by this many workers, exactly as
            torch's ``div_`` divides (by the native core as it copies each partition into ``buf``,
            else by :func:`synchronize` before ``finalize``). 1: the sum.
        asynchronous: an asynchronous-training exchange (BYTEPS_ENABLE_ASYNC): the first call
            per name hands the servers the parameters (rank 0's are kept), later calls push a
            delta; each returns the servers' latest parameters (docs/async.md).
        compression: the wire compressor of a push_pull's partitions that cross the network
            (a :class:`byteps.compression.WireCompressor`); None: the job's default
            (BYTEPS_COMPRESSOR, usually none); False: none (docs/compression.md).
        sync: the caller synchronizes the handle at once (a synchronous API call): a small op may
            then run its round trip on the calling thread (core/pipeline/bps_worker.h submit_direct).
        process_set: None for every worker, or ``(set id, sorted global ranks)`` of a process set this
            worker is a member of: only its members take part (the same id and ranks on each of them).

    Returns:
        An integer handle for :func:`poll` / :func:`synchronize`.

    Raises:
        ValueError: a push_pull of the same name is already in flight in this process.
    """
    job = _require()
    if name in job.inflight:  # this rank's own misuse, not a call the others make: nothing to abandon
        raise _in_flight(name)
    try:
        op = _make_op(job, name, buf, dtype, shape, broadcast_root, priority, asynchronous, compression, process_set,
                      average_by)
    except ValueError as e:
        abandon(name, process_set, e)
        raise
    process_set = op.pset
    handle = next(job.next_handle)
    job.handles[handle] = (op, finalize)
    if job.engine is None or (process_set is not None and len(process_set[1]) == 1):
        op._finish()  # alone: the sum over one worker is the tensor itself
        return handle
    with job.inflight_lock:
        if name in job.inflight:  # another thread started it meanwhile
            del job.handles[handle]
            raise _in_flight(name)
        job.inflight[name] = op
    op.callbacks.append(lambda done: _leave_inflight(job, done))
    try:
        job.engine.submit(op, sync)
    except BaseException:
        _leave_inflight(job, op)
        del job.handles[handle]
        raise
    return handle


def _in_flight(name):
    return ValueError(f"a push_pull or broadcast named {name!r} is already in flight; synchronize it before "
                      "starting another one with the same name")


def abandon(name, process_set, error):
    """This rank refused the call named ``name`` before its declaration (``error``): the other ranks must
    not wait for ours (core/engine.py Engine.abandon). For the plugins' own argument checks too."""
    job = _require()
    if job.engine is not None:
        job.engine.abandon(name, process_set, f"{type(error).__name__}: {error}")


def _make_op(job, name, buf, dtype, shape, broadcast_root, priority, asynchronous, compression, process_set,
             average_by):
    """submit()'s Op, once its arguments are checked (ValueError naming the tensor)."""
    if broadcast_root is not None and not 0 <= broadcast_root < job.size:
        raise ValueError(f"root rank {broadcast_root} for tensor {name!r} is outside 0..{job.size - 1}")
    if process_set is not None:
        process_set = (int(process_set[0]), tuple(int(r) for r in process_set[1]))
        if job.rank not in process_set[1]:
            raise ValueError(f"tensor {name!r}: rank {job.rank} is not a member of process set {process_set[0]} "
                             f"(ranks {list(process_set[1])})")
        if broadcast_root is not None and broadcast_root not in process_set[1]:
            raise ValueError(f"root rank {broadcast_root} for tensor {name!r} is not a member of process set "
                             f"{process_set[0]} (ranks {list(process_set[1])})")
        if asynchronous:
            raise ValueError(f"asynchronous push_pull of {name!r}: process sets are not supported in async mode")
    cmd = Cmd.PUSHPULL if broadcast_root is None else Cmd.BROADCAST
    if asynchronous:
        if not job.cfg.enable_async:
            raise ValueError(f"asynchronous push_pull of {name!r} needs BYTEPS_ENABLE_ASYNC=1 on every node")
        cmd = Cmd.ASYNC_PUSHPULL
    op = Op(name, buf, dtype, shape, cmd=cmd, root=broadcast_root or 0, priority=priority, pset=process_set)
    if average_by != 1:
        if cmd != Cmd.PUSHPULL or dtype not in dtypes.FLOATING or average_by < 1:
            raise ValueError(f"average_by={average_by} for tensor {name!r}: only a synchronous-mode push_pull of a "
                             "float tensor is averaged in place (divide integers and the rest after synchronize)")
        op.divisor = int(average_by)
    if cmd == Cmd.PUSHPULL:
        op.codec = job.default_codec if compression is None else _compression.resolve(compression)
    return op


def _leave_inflight(job, op):
    """Forget ``op``'s name as in flight, unless it already names a later op (started after a
    synchronize that ran before this op's completion callback)."""
    with job.inflight_lock:
        if job.inflight.get(op.name) is op:
            del job.inflight[op.name]


def _lookup(handle):
    job = _require()
    try:
        return job, job.handles[handle]
    except KeyError:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)") from None


def poll(handle):
    """True when the operation behind ``handle`` has finished (successfully or not)."""
    job, (op, _) = _lookup(handle)
    if op.done.is_set():
        return True
    # a native op is done as soon as its last partition is in, before anyone has set its event (the
    # completion thread leaves that to the caller's synchronize() for a while: Engine.prompt)
    return op.native_id is not None and job.engine is not None and job.engine.native_done(op)


def wait_bounded(ready, what):
    """Call ``ready(seconds)``, a wait of its own that says whether it ended, until it says so; raise
    BytePSTimeoutError naming ``what`` after BYTEPS_TIMEOUT + 30 s. The engine fails every operation
    within BYTEPS_TIMEOUT: the margin only guards against a bug."""
    limit = _require().cfg.timeout + 30
    start = time.monotonic()
    while not ready(0.5):
        if time.monotonic() - start > limit:
            raise BytePSTimeoutError(f"synchronize() of {what} waited {limit:g} s")


def synchronize(handle):
    """Wait for ``handle``; raise its error, or return what its finalize callback returns."""
    job, (op, finalize) = _lookup(handle)
    engine = job.engine
    wait_bounded(lambda seconds: engine.native_wait(op, seconds) if op.native_id is not None and
                 engine._native is not None else op.done.wait(seconds), f"tensor {op.name!r}")
    del job.handles[handle]
    # the engine's callback drops the name from ``inflight`` and may run just after ``done`` is set:
    # a caller that starts the same name again at once must not be told it is still in flight
    _leave_inflight(job, op)
    if op.error is not None:
        raise op.error
    if op.divisor > 1 and not op.divided:  # it did not run in the native core, which divides as it copies
        _reduce.divide(op.buf, op.divisor, op.dtype)
    return finalize() if finalize is not None else None


def join():
    """Horovod's join(): this rank has no more data. Blocks until every rank has joined and returns the
    rank that joined last (the same on every rank). Meanwhile the other ranks' push_pulls complete
    with this rank contributing zeros (an average still divides by the full size); broadcasts fail
    on the ranks still running. Bounded by BYTEPS_TIMEOUT only if no rank makes progress: a rank
    that keeps training keeps the join open as long as it needs."""
    job = _require()
    if job.engine is None:
        return 0
    released = job.engine.request("join")
    while not released.wait(1.0):
        if job.engine.failure is not None:
            raise job.engine.failure
    if job.engine.failure is not None:
        raise job.engine.failure
    return job.engine.join_result


def barrier():
    """Block until every worker has called barrier() (bounded by BYTEPS_TIMEOUT)."""
    job = _require()
    if job.engine is None:
        return
    with job.barrier_lock:
        _meet(job, "barrier", "barrier()")


def exchange(name, value):
    """A barrier of every worker that hands each of them every worker's ``value`` (JSON-able):
    ``{rank: value}``. ``name`` must be the same on every worker and unique per call."""
    job = _require()
    if job.engine is None:
        return {job.rank: value}
    _meet(job, name, f"{name}:", value, slack=5)
    values = job.engine.barrier_values.pop(name, None)
    if values is None:
        raise BytePSTimeoutError(f"{name}: the scheduler released the barrier without the workers' values")
    return values


def _meet(job, name, what, value=None, slack=0):
    """Barrier ``name``, handing over ``value``; raise the job's failure, the scheduler's reason for failing
    it, or a time-out naming ``what``."""
    if not job.engine.request("barrier", name, value).wait(job.cfg.timeout + slack):
        raise BytePSTimeoutError(f"{what} waited {job.cfg.timeout:g} s (BYTEPS_TIMEOUT) for the other workers")
    if job.engine.failure is not None:
        raise job.engine.failure
    reason = job.engine.barrier_errors.pop(name, None)
    if reason is not None:
        job.engine.barrier_values.pop(name, None)
        raise BytePSError(f"{name}: {reason}")


def metrics():
    """A snapshot of what this worker's data plane did so far, as plain data (JSON-ready).

    Keys: ``rank``, ``size``, ``local_rank``, ``local_size``; ``servers`` (per server: ``index``,
    ``host``, ``colocated``, ``role``, ``weight`` in the k/n plan, ``transport`` ("tcp", "ucx: ...",
    or "none" for a server lost before its link opened), ``bytes_sent``, ``bytes_received``); ``partition_bytes`` and ``credit_bytes`` as agreed at start-up;
    ``placement_mode``; ``tensors`` (declared name -> tensor key); ``partitions`` (declared name ->
    the partitions of each native table it has, one per size, kind and codec, in first-use order);
    ``native`` (the native pipeline's counters: ops run whole, averages divided, synchronous calls
    run on the caller's thread, direct links, ``stages``, ``compressed_pushes``, ``replies_in_place``,
    the local reduce's counters with ``for_peers``); ``credit_stalls``; ``local_group`` (this
    machine's processes summed locally, or None); ``local_strategy`` (None without a local reduce,
    else ``owners``, the topology ``plan``'s strategy, ``groups``, ``roots`` and ``nccl_stages``).
    A job of one worker process has no data plane: only the rank fields, with ``servers`` empty.
    """
    job = _require()
    base = {"rank": job.rank, "size": job.size, "local_rank": job.cfg.local_rank, "local_size": job.cfg.local_size}
    if job.engine is None:
        return dict(base, servers=[])
    return dict(base, **_snapshot(job.engine.metrics))


def transport_bytes():
    """Bytes this worker sent to and received from each server on its data sockets (headers and
    bodies, shared-memory descriptors included): ``{"sent": {server: n}, "received": {server: n}}``.
    Used to measure what compression saves (docs/compression.md)."""
    job = _require()
    if job.engine is None:
        return {"sent": {}, "received": {}}
    return _snapshot(job.engine.transport_bytes)


def _snapshot(read):
    """``read()``, again while it fails because the engine thread added a server's first count meanwhile."""
    while True:
        try:
            return read()
        except RuntimeError:
            continue
