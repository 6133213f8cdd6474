"""The worker's engine: the control plane of one training process, on one background thread.

The data plane is native (thread "byteps-net", through core/_worker_core.pyx; "byteps-complete"
delivers finished ops). This thread does what is per job, per tensor or rare, as in Horovod's
background loop: start-up (core/engine_setup.py), tensor declarations (the scheduler compares a new
(name, shape, dtype) across workers and returns one key, or a mismatch error for all), heartbeats,
barriers, join(), elastic servers (core/engine_elastic.py), the timeline, and time-outs of ops still
waiting for their declaration. ZeroMQ carries only this control plane, and ZeroMQ sockets are not
thread-safe: this thread owns them all but the local ROUTER, which it hands to the native core with the
direct links that carry every partition (docs/architecture.md).
"""
import collections
import fcntl
import itertools
import os
import threading
import time

import zmq

from byteps import autotune, cpus, timeline
from byteps.errors import BytePSError, BytePSTimeoutError, ConfigError, PeerLostError, TensorMismatchError
from byteps.log import logger

from . import auth, dtypes, shm, stages, wire
from .engine_elastic import ElasticServers
from .engine_native import KINDS, NativePlane
from .engine_setup import EngineSetup
from .ops import Op
from .threads import name_native

from . import _worker_core

Cmd = wire.Cmd
#: plain ints: pyzmq's flag enums cost a microsecond per operation
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class Engine(EngineSetup, NativePlane, ElasticServers):
    """A worker process's engine: the training thread's API (submit, request, stop) and the engine
    thread's loop; start-up, the native tables and elastic membership are its mixins' (one file each)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self._inbox = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        fcntl.fcntl(self._wake_w, fcntl.F_SETFL, os.O_NONBLOCK)
        fcntl.fcntl(self._wake_r, fcntl.F_SETFL, os.O_NONBLOCK)
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self.failure = None
        self.book = None
        self._cpu_slot = None  # (index, count) among the job's worker processes on this host
        self.rank = self.size = None
        self.tuning = None          # autotune.Agreement: the job's partition size and this worker's credit
        self._agreed = None         # the scheduler's release of the agreement (see _tune)
        self.partition_bytes = None  # a new tensor's partition size, once a model's size changed it (expect_model)
        self._lost_at_start = set()  # indices of servers lost while init() ran (elastic): not waited for
        self._thread = threading.Thread(target=self._main, name="byteps-engine", daemon=True)
        self._declaring = {}        # (name, seq, set id) -> [ops waiting for the key]
        self._decl_spec = {}        # (name, seq, set id) -> spec
        self._decl_pending = {}     # (name, spec) -> (name, seq, set id) of its declaration in flight
        self._decl_seq = collections.Counter()
        self._keys = {}             # (name, spec) -> tensor key
        self._requests = {}         # ("barrier"|"leave", name) -> event set on release
        self.barrier_values = {}    # barrier name -> {rank: value} of a barrier whose members sent values
        self.barrier_errors = {}    # barrier name -> the scheduler's reason for failing it
        self._left = False
        self.servers = []
        self._stall_noted = False
        # shared memory with servers on this machine (core/shm.py)
        self._shm = None
        self._maps = shm.PeerMaps()
        self._staging = {}          # wire key -> (shared view, descriptor prefix) of this worker's copy
        self.colocated = []         # per server: exchange data through shared memory
        # intra-machine aggregation (core/local.py)
        self.local = None           # LocalPlan when this machine's processes reduce together
        self._local_sock = None     # ROUTER: LOCAL_READY / LOCAL_DONE from this machine's other processes
        self._local_peers = {}      # local rank -> DEALER to its ROUTER
        self._link_offers = {}      # local rank -> (port, token, DEALER identity, ring offer or None): links offered
        self._dropped = stages.from_env()  # optional stages switched off by BYTEPS_PIPELINE
        self._stage_lists = {}      # (colocated, kind, local) -> the partition's stages (core/stages.py)
        self.joined = frozenset()   # ranks in join() (Horovod): they add zeros, and still own their partitions
        self._joins_ended = 0  # joins this process saw end: LOCAL_READY carries its parity (wire.FLAG_JOIN_EPOCH)
        self._gate = auth.Gate(None)  # who may send to our local ROUTER (set up in _knock_all)
        self.join_result = None     # the last rank to join, once every rank has
        # the native data plane (core/pipeline/bps_worker.h): owns the links to servers and local peers
        self._native = None
        self._gpu = None  # CUDA tensors' copy stages: None (not loaded yet), "" (loaded) or why they cannot run
        self.nccl_stages = False  # CUDA push_pulls take the NCCL stages (set at start-up: _nccl_stages)
        self._native_ops = {}       # native id -> Op, until its completion is delivered
        self._native_ids = itertools.count(1)
        self._native_parts = {}     # (tkey, nbytes, cmd, root_self) -> (native table id, partitions)
        self._native_specs = {}     # native table id -> _TableSpec (elastic servers rebuild its partitions)
        self._native_lock = threading.RLock()  # staging regions: allocated by the engine and submitting threads
        self._graveyard = {}        # native id -> Op whose tensor ZeroMQ may still read (failed ops)
        self._completer = None      # thread delivering native completions
        self.native_submitted = 0   # ops handed to the native thread (tests check the path really ran)
        self.native_averaged = 0    # of them, averages the native core divided as it copied the sums in
        self._native_local = False  # the native thread runs this machine's local reduce (set once at start)
        self._owed_zeros = {}  # bytes -> zeros: a joined owner's own (absent) copy (_reduce_owed)
        self.native_local_submitted = 0  # push_pulls the native thread reduced locally

    # ---------------------------------------------------------------- training-thread side

    def start(self):
        """Start the thread, register, and wait for the address book (bounded by BYTEPS_TIMEOUT)."""
        self._thread.start()
        limit = self.cfg.timeout + 5
        if not self._ready.wait(limit):
            self.failure = self.failure or BytePSTimeoutError(
                f"init() waited {limit:g} s for the scheduler at {self.cfg.scheduler_endpoint} to start the job")
        if self.failure is not None:
            self.stop()
            raise self.failure
        if self._cpu_slot is not None:  # the training thread: the one that polls (byteps/cpus.py)
            cpus.bind_worker(*self._cpu_slot, self.cfg.cpu_bind)

    def submit(self, op, sync=False):
        """Start ``op``. ``sync``: the caller waits for it at once (a synchronous API call), so a small
        op may run its round trip on this thread (BpsWorkerCore::submit_direct)."""
        if self.failure is not None:
            raise self.failure
        op.partition_bytes = self.partition_bytes
        if not self._inbox and self._native_eligible(op):
            key = self._keys.get((op.name, op.spec))
            if key is not None:  # declared before: no engine hop
                self._native_submit(op, key, sync, lazy=True)
                return op
        self._inbox.append(op)
        self._wake()
        return op

    def abandon(self, name, process_set, reason):
        """A call this rank refused before declaring ``name`` (common.submit), so that the ranks that make
        it get an error naming us at once (any thread): in the servers' rounds of a tensor we used before
        (_abandon_rounds, at once, as submit() would), else in its declaration (_abandon)."""
        if not self._inbox and self._abandon_rounds(name, process_set, reason):
            return
        self._inbox.append(("abandon", name, None, (process_set, reason)))
        self._wake()

    def request(self, kind, name="", value=None):
        """Run a control-plane request ("barrier", "leave", "join" or "timeline"); return an event set on release.

        A barrier with a ``value`` hands every member all of them: ``barrier_values[name]`` maps each
        rank to its value once the event is set."""
        ev = threading.Event()
        self._inbox.append((kind, name, ev, value))
        self._wake()
        return ev

    def stop(self):
        """Stop the thread (after shutdown's release, or to abandon the job) and free the wake pipe."""
        self._stopped.set()
        self._wake()
        self._thread.join(10)
        if self._wake_w is not None:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = None

    def _wake(self):
        if self._wake_w is None:
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full, so the engine is awake anyway
            pass

    def _read_wake(self):
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    # ---------------------------------------------------------------- engine thread

    def _main(self):
        name_native()
        try:
            self._setup()
            self._loop()
        except BytePSError as e:
            self._abort(e)
        except Exception as e:  # a bug: fail every caller loudly rather than hang them
            logger.exception("byteps engine thread crashed")
            self._abort(BytePSError(f"byteps engine thread crashed: {e!r}"))
        finally:
            self._close()
            self._ready.set()

    def _abort(self, error):
        self.failure = self.failure or error
        if self._native is not None:
            self._native.fail_all()
        for op in [op for ops in self._declaring.values() for op in ops]:  # the native core failed the others
            op.fail(self.failure)
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, Op):
                item.fail(self.failure)
            else:
                item[2].set()
        for ev in self._requests.values():
            ev.set()

    def _loop(self):
        tick_ms = min(self.cfg.heartbeat_interval, 1.0) * 1000
        next_check = 0.0
        while not self._stopped.is_set():
            events = self.poller.poll(timeout=tick_ms)
            began = time.monotonic()
            for sock, _ in events:
                if sock == self._wake_r:
                    self._read_wake()
                elif sock is self.control.sock:
                    self._drain(sock, lambda _: self._on_control())
            self._drain_native()  # the servers' replies come on links the native thread reads
            self._drain_inbox()
            now = time.monotonic()
            if now - began > self.cfg.heartbeat_timeout / 3:  # heartbeats wait on this loop: say why they were late
                logger.warning("the engine loop was busy for %.1f s", now - began)
            self.control.tick()
            timeline.flush(self.control)
            if now >= next_check:  # walks every outstanding op: not once per message
                self._check_timeouts()
                if not self._stall_noted:
                    stalls, first = self._native.credit_stalls()
                    if stalls:
                        self._note_stall(repr(first))
                next_check = now + 0.5
            if self._left:  # shutdown() released by the scheduler
                return

    @staticmethod
    def _drain(sock, handle, limit=256):
        """Handle every message already queued on a socket (bounded, so others get a turn)."""
        for _ in range(limit):
            handle(sock)
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                break

    @staticmethod
    def _discard(sock):
        """Read and drop the rest of a multi-frame message."""
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv_into(bytearray())

    @staticmethod
    def _drain_data(sock, handle, limit=256):
        """As _drain, for the servers' and local peers' sockets: each message is taken whole."""
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            handle(sock, frames)

    def _close(self):
        ctl = getattr(self, "control", None)
        if self._native is not None:
            self._stopped.set()
            if self._completer is not None:
                self._completer.join(5)
            timeline.remember_threads()  # byteps-net and byteps-reduce, before they end
            self._native.stop()  # before the local ROUTER it polls is closed
            for nid in list(self._native_ops):  # never leave a caller waiting on a stopped thread
                op = self._native_ops.pop(nid, None)
                if op is not None:
                    op.fail(self.failure or BytePSError("byteps shut down while this push_pull was in flight"))
        for sock in [*self.servers, *self._local_peers.values(), self._local_sock]:
            if sock is not None:
                sock.close(linger=0)
        if ctl is not None:
            timeline.flush(ctl, final=True)  # after the native thread stopped: its last spans are in
            ctl.close()
        self.ctx.term()
        self._staging.clear()
        self._maps.close()
        if self._shm is not None:
            self._shm.close()

    # ---------------------------------------------------------------- control messages

    def _on_control(self):
        header, body = self.control.recv()
        cmd = header.cmd
        if cmd in (Cmd.HEARTBEAT, Cmd.CLOCK):  # ControlClient.recv took the clock sample
            return
        if cmd == Cmd.CHALLENGE:
            self.control.on_challenge(body)
            return
        if cmd == Cmd.ADDRBOOK:
            self.book = body
            self.rank = body["you"]["rank"]
            self.size = body["size"]
            self.control.node_id = body["you"]["node_id"]
            if body.get("timeline") or timeline.recorder is not None:  # BYTEPS_TIMELINE here or at the scheduler
                self._start_timeline()
        elif cmd == Cmd.DECLARE:
            self._on_declared(body)
        elif cmd == Cmd.BARRIER and body.get("name") == autotune.AGREE_BARRIER:
            self._agreed = body
        elif cmd == Cmd.BARRIER:
            if "error" in body:  # the scheduler gave up on it (members stalled in different collectives)
                self.barrier_errors[body.get("name")] = body["error"]
            if "values" in body:
                self.barrier_values[body.get("name")] = {int(r): v for r, v in body["values"].items()}
            self._release("barrier", body.get("name"))
        elif cmd == Cmd.LEAVE:
            self._left = True
            self._release("leave")
        elif cmd == Cmd.JOIN:
            self._on_join(body)
        elif cmd == Cmd.TRACE:  # another worker called start_timeline(): record too
            self._start_timeline()
        elif cmd == Cmd.MEMBERS:
            self._on_members(body)
        elif cmd == Cmd.ABORT:
            raise PeerLostError(body.get("reason", "the scheduler aborted the job"))
        elif cmd == Cmd.ERROR:
            raise BytePSError(f"the scheduler refused this worker: {body.get('error')}")
        else:
            logger.warning("unexpected control message %s", Cmd(cmd).name)

    def _release(self, kind, name=""):
        """The scheduler released our request (barrier, leave or join): wake its caller."""
        ev = self._requests.pop((kind, name), None)
        if ev is not None:
            ev.set()

    def _start_timeline(self, path=""):
        """Record spans from now on (start_timeline(), or the scheduler relaying another node's)."""
        rec = timeline.start(self.cfg, path)
        rec.wake = self._wake
        rec.node.update(role="worker", rank=self.rank, worker_id=self.cfg.worker_id, local_rank=self.cfg.local_rank,
                        host=self.cfg.node_host)
        if self._native is not None:
            rec.add_native(_worker_core.trace_buffer())

    def _on_join(self, body):
        if body["done"]:
            # every rank is in join(), nothing is in flight: a sync point where rounds restart at 0
            self.joined = frozenset()
            self._joins_ended += 1
            self._native.reset_rounds()
            if self._native_local:  # before the epoch flips: a copy of the new epoch is for our next op
                self._native.set_self_joined(False)
            self._native.set_join_ends(self._joins_ended)  # before our next op's copies go out
            self.join_result = body["last"]
            if self._native_local:
                self._native.set_local_joined(0)
            self._release("join")
            return
        self.joined = frozenset(body["joined"])
        if self.local is None:
            return
        if self._native_local:
            # a joined process has no ops of its own, but owns partitions of its peers' ops: its native
            # core reduces them, adding nothing of its own (_reduce_owed). Owners stop waiting for
            # joined ranks' copies
            if self.rank in self.joined:
                self._native.set_self_joined(True)
            self._native.set_local_joined(sum(1 << w["local_rank"] for w in self.local.peers
                                              if w["rank"] in self.joined))

    def _on_declared(self, body):
        ident = (body.get("name"), body.get("seq"), body.get("set_id", 0))
        ops = self._declaring.pop(ident, [])
        spec = self._decl_spec.pop(ident, None)
        self._decl_pending.pop((ident[0], spec), None)
        if "error" in body:
            err = TensorMismatchError(body["error"])
            for op in ops:
                op.fail(err)
            return
        self._keys[(ident[0], spec)] = body["key"]
        for op in ops:
            self._dispatch(op, body["key"])

    # ---------------------------------------------------------------- declarations and dispatch

    def _drain_inbox(self):
        done = 0
        while self._inbox:
            done += 1
            if done % 128 == 0:  # a burst (10,000 tensors in one step) must not stop our heartbeats
                self.control.beat()
            item = self._inbox.popleft()
            if not isinstance(item, Op):
                kind, name, ev, value = item
                if kind == "timeline":  # start_timeline(name): record, and tell the scheduler at once
                    self._start_timeline(name)
                    timeline.recorder.flush_due = True
                    ev.set()
                    continue
                if kind == "abandon":
                    self._abandon(name, *value)
                    continue
                self._requests[(kind, name)] = ev
                cmd = {"barrier": Cmd.BARRIER, "leave": Cmd.LEAVE, "join": Cmd.JOIN}[kind]
                self.control.send(cmd, {"name": name} if value is None else {"name": name, "value": value})
                continue
            op = item
            key = self._keys.get((op.name, op.spec))
            if key is not None:
                self._dispatch(op, key)
                continue
            waiting = self._decl_pending.get((op.name, op.spec))  # a dict: 10,000 new tensors stay linear
            if waiting is None:
                set_id = 0 if op.pset is None else op.pset[0]
                seq = self._next_seq(op.name, set_id)
                waiting = (op.name, seq, set_id)
                self._decl_spec[waiting] = op.spec
                self._decl_pending[(op.name, op.spec)] = waiting
                self._declaring[waiting] = []
                body = {"name": op.name, "seq": seq, "shape": list(op.shape), "dtype": dtypes.name(op.dtype),
                        "kind": KINDS[op.cmd]}
                if op.pset is not None:
                    body.update(set_id=set_id, members=list(op.pset[1]))
                self.control.send(Cmd.DECLARE, body)
            self._declaring[waiting].append(op)

    def _abandon(self, name, pset, reason):
        """Declare ``name`` abandoned, with the reason, in the declaration this rank would have made (so
        later ones stay in step); the scheduler fails it on every rank. A name this rank ran before has a
        key the others reuse without declaring: its rounds are abandoned at the servers (_abandon_rounds)."""
        set_id, members = 0, None
        if pset is not None:
            set_id, members = int(pset[0]), sorted(int(r) for r in pset[1])
            if self.rank not in members:  # the members do not wait for a non-member
                return
        if self._abandon_rounds(name, pset, reason):
            return
        if any(n == name for n, _ in self._keys) or any(n == name for n, _ in self._decl_pending):
            return  # its declaration in flight
        body = {"name": name, "seq": self._next_seq(name, set_id), "abandoned": reason}
        if members is not None:
            body.update(set_id=set_id, members=members)
        self.control.send(Cmd.DECLARE, body)

    def _next_seq(self, name, set_id):
        """This rank's count of declarations of ``name``, per process set: a set's members meet each other."""
        seq = self._decl_seq[(name, set_id)]
        self._decl_seq[(name, set_id)] += 1
        return seq

    def _dispatch(self, op, tkey):
        """Hand the op, now keyed, to the native core."""
        if timeline.recorder is not None:
            timeline.recorder.keys[tkey] = op.name
        if not self._native_eligible(op):  # only the native core re-sends a lost server's partitions (docs/elastic.md)
            op.fail(ConfigError(f"tensor {op.name!r}: BYTEPS_ELASTIC=1 supports plain push_pull and broadcast "
                                "(no compression, process sets, asynchronous training or join())"))
            return
        self._native_submit(op, tkey)

    def _note_stall(self, name):
        """Log (once: _loop asks only until then) that the send queue's head went past a stalled credit."""
        self._stall_noted = True
        logger.info("tensor %s went past the scheduling credit: what was in flight had no reply for %.0f s (a "
                    "slow peer, or workers that give a tensor different priorities; logged once)", name,
                    _worker_core.CREDIT_STALL_S)

    # ---------------------------------------------------------------- timeouts

    def _check_timeouts(self):
        """Fail ops that waited BYTEPS_TIMEOUT for their declaration's answer (the native core times
        out the ops it runs, naming the server or local rank it waited for)."""
        now = time.monotonic()
        limit = self.cfg.timeout
        for waiting in self._declaring.values():
            for op in [op for op in waiting if now - op.started > limit]:
                waiting.remove(op)
                op.fail(BytePSTimeoutError(
                    f"push_pull of tensor {op.name!r} waited {now - op.started:.0f} s (BYTEPS_TIMEOUT={limit:g}) "
                    "for the scheduler's answer to its declaration (do all workers use this tensor name?)"))
