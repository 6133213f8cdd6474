"""Summation Service server event loop.

Data plane: one ROUTER socket on DMLC_NODE_HOST (random port, announced to the scheduler).
A worker sends ``[header PUSHPULL(key, round), partition bytes]``; the server

* holds the first push of a round as it arrived (ZeroMQ's own message buffer, no copy), makes
  the key's page-aligned store the sum of the first two pushes in one pass (``sum_many``, a
  Cython ``nogil`` kernel), and sums every later push into the store from its message buffer,
* answers all workers of the round with the store, zero-copy, once every worker has pushed.

A worker on the same machine sends a shared-memory descriptor instead of the bytes (FLAG_SHM):
the server sums straight from the worker's region and answers with a descriptor of its store,
which lives in shared memory too (core/shm.py). When a single machine pushes (one worker machine,
its processes reduced locally), the sum is that push: the server answers with the pusher's own
region and copies nothing.

A worker on another machine may send a compressed partition (FLAG_COMPRESSED, byteps/compression.py):
the native thread decodes it into the store (which stays in the tensor's dtype), checks that every
network push of the round is compressed alike, and answers those workers with the re-encoded sum
where the method allows (raw otherwise): summation/native/compressed_rounds.h.

Each key has two stores used by alternate rounds: a worker can push round r+1 as soon as it
has the reply of round r, while ZeroMQ may still be sending round r's replies to the others
from the other store. Round r+2 cannot start before every worker has received round r.

A push of the wrong round, a duplicate, or a length/dtype that differs from the round's first
push fails that round for every worker of it (each gets an ERROR naming the ranks and values),
so no worker waits forever and no bytes are silently truncated.

Native data plane: once the first address book has arrived, the data socket belongs to the thread
"byteps-serve" (summation/native/bps_server.h through summation/_server_core.pyx), which does all of the above
for plain, compressed and asynchronous pushes and process sets' keys, without the GIL. This loop
keeps the control plane and handles what that thread forwards: handshakes, strangers, PROBE, LINK,
and pushes marked FLAG_PYTHON; its replies go out through the native thread.
"""
import itertools
import os
import time

import zmq

from byteps import placement, service, timeline
from byteps.core import auth, dtypes, shm, transport, wire
from byteps.core._reduce import aligned_empty, copy_into, get_num_threads, sum_into, sum_many
from byteps.core.control import ControlClient
from byteps.errors import BytePSError, PeerLostError, ProtocolError
from byteps.log import logger

from .sum_pool import SumPool

from . import _server_core

Cmd = wire.Cmd
#: replies whose body is smaller than this are copied into ZeroMQ (cheaper than a zero-copy send)
COPY_BELOW = transport.COPY_BELOW
#: log a stall warning when a round has waited this long for its last pushes
STALL_WARNING_S = 60.0


#: a server has no steps: it sends its spans to the scheduler this often while tracing
SERVER_FLUSH_S = 5.0


def _name(h):
    return f"key {wire.split_key(h.key)}"


class _Round:
    """State of one key: the current round's arrivals and the two stores."""

    __slots__ = ("round", "nbytes", "dtype", "alloc", "_stores", "_shared", "senders", "waiters", "first", "since",
                 "error", "root", "root_ident", "warned", "echo", "held", "header",
                 "key", "pending", "ready")

    def __init__(self, nbytes, dtype, alloc):
        self.round = 0
        self.nbytes = nbytes
        self.dtype = dtype
        self.alloc = alloc
        # the stores are allocated at first use, once a body of nbytes has arrived: never from a
        # header's length field alone (a malformed header must not reserve gigabytes)
        self._stores = self._shared = None
        self.key = 0
        self.pending = 0         # sums of this round still running on an engine thread (summation/sum_pool.py)
        self.reset()

    def allocate(self, nbytes, alloc):
        """Two stores (alternate rounds), in shared memory when colocated workers may read them."""
        self.nbytes = nbytes
        if alloc is None:
            self._stores = (aligned_empty(nbytes), aligned_empty(nbytes))
            self._shared = None
        else:
            (a, pa), (b, pb) = alloc.alloc(nbytes), alloc.alloc(nbytes)
            self._stores, self._shared = (a, b), (pa, pb)

    @property
    def stores(self):
        if self._stores is None:
            self.allocate(self.nbytes, self.alloc)
        return self._stores

    @property
    def shared(self):
        _ = self.stores  # allocated together
        return self._shared

    def reset(self):
        self.senders = []        # ranks that pushed this round, in arrival order
        self.waiters = []        # their ROUTER identities
        self.first = None        # (rank, nbytes, dtype) of the first push, for error messages
        self.since = 0.0
        self.error = None
        self.root = None
        self.root_ident = None
        self.warned = False
        self.echo = None         # a lone pusher's shared region: the sum is the push itself
        self.held = None         # the round's first push, not yet copied (a shared view or a zmq Frame)
        self.header = None       # the round's last header (to complete it when a rank joins)
        self.ready = None        # header of a round whose messages are all in but whose sums still run

    @property
    def store(self):
        return self.stores[self.round & 1]

    def store_descriptor(self):
        return shm.describe(self.shared[self.round & 1], self.nbytes)


class Server:
    def __init__(self, cfg, ctx=None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 1000)
        self.data.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # no send high-water mark: a reply must never block the loop (a worker that stops reading
        # would freeze every other worker and our heartbeats); what queues is bounded by what that
        # worker pushed, since each reply answers one of its pushes
        self.data.setsockopt(zmq.SNDHWM, 0)
        self.port = self.data.bind_to_random_port(f"tcp://{cfg.node_host}")
        # ss_role: BYTEPS_SERVER_ROLE; "auto" is resolved from the address book (byteps/placement.py)
        info = {"role": "server", "host": cfg.node_host, "port": self.port, "ss_role": cfg.server_role,
                "elastic": cfg.elastic}  # an elastic server may join a running job (docs/elastic.md)
        self.alloc = self.probe = None
        if cfg.enable_ipc and shm.supported():
            self.alloc = shm.Allocator("byteps-server")
            self.probe = shm.Probe()
            info["shm"] = self.probe.info()
        self.maps = shm.PeerMaps()
        self.gate = auth.Gate(auth.job_secret())  # workers prove they know the job's secret first
        if cfg.timeline:
            timeline.start(cfg)
        self.control = ControlClient(self.ctx, cfg, info)
        self.keys = {}
        self.num_workers = None
        self.pushers = None
        self.joined = ()         # ranks in join(): push_pulls complete without them (they add zeros)
        self.active_pushers = None
        self.set_pushers = {}    # tensor key of a process set -> how many members push it (for the job)
        self.index = None
        self.epoch = None
        if not _server_core.available:
            raise BytePSError(f"the native server core cannot run here: {_server_core.unavailable_reason}")
        self._frames, self._next = [], 0
        self.pool = SumPool(cfg.server_engine_threads)  # BYTEPS_SERVER_ENGINE_THREAD
        self.poller = None
        # the native data plane (summation/native/bps_server.h): owns the data socket once the address book is in
        self.core = None
        self._zero_copy = {}  # token -> a body ZeroMQ still reads (sent through the native thread)
        self._tokens = itertools.count()
        self.link_port = None  # where workers open direct links to the native thread, once it listens
        self.ucx_port = None   # where workers connect UCX endpoints (BYTEPS_TRANSPORT=ucx), once it listens

    # ---------------------------------------------------------------- control plane

    def _on_control(self):
        header, body = self.control.recv()
        if header.cmd == Cmd.CHALLENGE:
            self.control.on_challenge(body)
        elif header.cmd == Cmd.ADDRBOOK:
            self.epoch = body["epoch"]
            self.num_workers = body["size"]
            # one push_pull per machine when machines reduce locally first; broadcasts involve every rank
            self.pushers = body.get("pushers", self.num_workers)
            self.index = body["you"]["index"]
            self.control.node_id = body["you"]["node_id"]
            self.ranks = {w["node_id"]: w["rank"] for w in body["workers"]}
            logger.info("server %d serving %d workers (epoch %d)", self.index, self.num_workers, self.epoch)
            self._log_role(body)
            if body.get("timeline") or timeline.recorder is not None:  # BYTEPS_TIMELINE here or at the scheduler
                timeline.start(self.cfg).node.update(role="server", index=self.index, host=self.cfg.node_host)
            if self.core is None:
                self._start_native()
            if self.core is not None:  # before our answer: no push can arrive before the book
                self.core.set_book(self.num_workers, self.pushers, self.control.node_id, self.ranks)
            # workers get the address book only after every server has answered this
            self.control.send(Cmd.ADDRBOOK, {"epoch": self.epoch})
        elif header.cmd == Cmd.LEAVE:
            # every worker called shutdown(): they may init() again, restarting every key at round 0
            self._reset_keys()
            self.num_workers = None
            if self.core is not None:
                self.core.set_book(None, None, self.control.node_id, {})
        elif header.cmd == Cmd.JOIN:
            self._on_join(body)
        elif header.cmd == Cmd.DECLARE:  # a process set's key: its members' pushes complete its rounds
            self.set_pushers[int(body["key"])] = int(body["pushers"])
            if self.core is not None:  # before our answer: no member pushes before every server knows
                self.core.set_pushers(int(body["key"]), int(body["pushers"]))
            self.control.send(Cmd.DECLARE, {"key": body["key"]})
        elif header.cmd == Cmd.TRACE:  # a worker called start_timeline(): record too
            rec = timeline.start(self.cfg)
            rec.node.update(role="server", index=self.index, host=self.cfg.node_host)
            if self.core is not None:
                rec.add_native(_server_core.trace_buffer())
        elif header.cmd == Cmd.MEMBERS:  # the server set changed (docs/elastic.md): say our new share
            logger.warning("server %d: membership %d (%s): shares %s", self.index, body.get("members"),
                           body.get("reason"), body.get("shares"))
        elif header.cmd == Cmd.TERMINATE:
            if body.get("reason"):
                logger.warning("server %d leaves the job: %s", self.index, body["reason"])
            return 0
        elif header.cmd == Cmd.ABORT:
            raise PeerLostError(body.get("reason", "the scheduler aborted the job"))
        elif header.cmd == Cmd.ERROR:
            raise BytePSError(f"the scheduler refused this server: {body.get('error')}")
        return None

    def _log_role(self, book):
        """Say which role (colocated SS_GPU / standalone SS_CPU) and share of the model this server has."""
        roles = placement.server_roles(book)
        weights = placement.weights_for_book(book, roles)
        at = [s["index"] for s in book["servers"]].index(self.index)  # elastic: indices outlive positions
        logger.info("server %d on %s is %s (%s): sums %d/%d of every partition's bytes", self.index,
                    self.cfg.node_host, roles[at],
                    "BYTEPS_SERVER_ROLE" if self.cfg.server_role != "auto" else "same host as a worker"
                    if roles[at] == "colocated" else "no worker on its host", weights[at],
                    sum(weights))

    def _reset_keys(self):
        if self.core is not None:
            self.core.reset()  # its keys, stores (once no reply reads them) and peers' mappings
        self.keys.clear()
        self.maps.close()
        if self.alloc is not None:
            self.alloc.reset()

    def _on_join(self, body):
        if body["done"]:  # everyone joined: a sync point, every key restarts at round 0
            self.joined = ()
            if self.core is not None:
                self.core.set_join(True, (), None)
            self._reset_keys()
            # the scheduler releases the workers from join() only once every server has said this
            self.control.send(Cmd.JOIN, {"done": True})
            return
        self.joined = tuple(body["joined"])
        self.active_pushers = body["pushers"]
        if self.core is not None:  # it completes its own rounds that waited only for these ranks
            self.core.set_join(False, self.joined, self.active_pushers)
        for st in self.keys.values():  # rounds that were waiting only for a rank that just joined
            h = st.header
            if h is None or not st.senders or self._set_pushers(h) is not None:  # join() is the whole job's
                continue
            if h.cmd == Cmd.BROADCAST:  # pushed before this JOIN arrived: the joined rank never sends its part
                st.error = st.error or self._joined_broadcast_error()
                self._maybe_complete(st, h)
            elif h.cmd == Cmd.PUSHPULL and len(st.senders) >= self.active_pushers:
                self._maybe_complete(st, h)

    def _joined_broadcast_error(self):
        return (f"broadcast is not supported while ranks {list(self.joined)} have joined (join()); it works "
                "again once every rank has joined")

    def _set_pushers(self, h):
        """How many members push this key, if it is a process set's (the scheduler said so); else None."""
        return self.set_pushers.get(wire.split_key(h.key)[0]) if self.set_pushers else None

    def _expected(self, h):
        """Messages that complete a round: a process set's members; one push_pull per machine still pushing;
        every rank for a broadcast."""
        members = self._set_pushers(h)
        if members is not None:
            return members
        if h.cmd != Cmd.PUSHPULL:
            return self.num_workers
        return self.active_pushers if self.joined else self.pushers

    # ---------------------------------------------------------------- native data plane

    def _start_native(self):
        """Hand the data socket to the native thread byteps-serve (summation/native/bps_server.h). Python never reads it:
        workers learn its address from the same address book, so nothing arrives before this."""
        core = _server_core.ServerCore(self.data, self.gate.secret is not None, self.alloc is not None,
                                       self.cfg.server_engine_threads, get_num_threads())
        core.set_adopt_rounds(self.cfg.elastic)
        core.set_async(self.cfg.enable_async)
        try:  # workers' direct links (core/transport/bps_link.h); ZeroMQ serves them meanwhile
            fd, self.link_port = transport.listen_link(self.cfg.node_host)
            core.set_listener(fd)
        except OSError as e:
            logger.warning("no direct links (cannot listen on %s: %s): workers' data goes through ZeroMQ",
                           self.cfg.node_host, e)
        self.ucx_port = self._ucx_listen(core)
        for ident in self.gate.admitted():
            core.admit(ident, True)
        if timeline.recorder is not None:
            timeline.recorder.add_native(_server_core.trace_buffer())
        core.start()
        self.core = core
        if self.poller is not None:
            self.poller.register(core.notify_fd, zmq.POLLIN)
        logger.info("native data plane: pushes received, summed and answered on thread byteps-serve "
                    "(%s)", f"{self.cfg.server_engine_threads} sum threads" if self.cfg.server_engine_threads
                    else "sums inline")

    def _ucx_listen(self, core):
        """A UCX listener for workers' endpoints (core/transport/bps_ucx.h) when this server's transport is UCX:
        its port, or None (workers then use TCP links or ZeroMQ)."""
        from byteps.core import ucx
        if ucx.choose(self.cfg.transport, _server_core) != "ucx":
            return None
        try:
            return core.ucx_listen(self.cfg.node_host)
        except RuntimeError as e:
            logger.warning("no UCX listener on %s (%s): workers' data goes over TCP links or ZeroMQ",
                           self.cfg.node_host, e)
            return None

    def _on_native(self):
        """What the native thread has for Python: log lines, released bodies, forwarded messages."""
        try:
            os.read(self.core.notify_fd, 8)  # first: a notification after this read is not lost
        except BlockingIOError:
            pass
        for line in self.core.logs():
            logger.warning("%s", line)
        for token in self.core.released():
            self._zero_copy.pop(token, None)
        for frames, auth_pending, handover in self.core.forwarded():
            try:
                if handover is not None:
                    self._take_handover(handover)
                self._handle(frames)
            finally:
                if auth_pending:  # the native thread holds this identity's later messages until it knows
                    self.core.admit(frames[0], self.gate.allows(frames[0]))

    def _take_handover(self, d):
        """A key the native thread had state for is Python's from now on (its first FLAG_PYTHON message):
        go on from that state, so a round mixing both kinds fails as it should."""
        st = _Round(d["nbytes"], d["dtype"], self.alloc)
        st.key, st.round = d["key"], d["round"]
        st.senders, st.waiters, st.first = list(d["senders"]), list(d["waiters"]), d["first"]
        st.since, st.error, st.warned = d["since"], d["error"], d["warned"]
        st.root, st.root_ident = d["root"], d["root_ident"]
        st.header = wire.unpack(d["header"]) if d["header"] is not None else None
        if d["partial"] is not None:  # the sum so far (its first push folded in)
            copy_into(st.store, d["partial"])
        self.keys[st.key] = st

    def native_stats(self):
        return self.core.stats() if self.core is not None else None

    # ---------------------------------------------------------------- data plane

    # The message being handled: all its frames were taken at once (core/transport.py); these read them in order.
    def _more(self):
        return self._next < len(self._frames)

    def _take(self):
        """The next frame of the current message: bytes, or a zero-copy frame for a large body."""
        frame = self._frames[self._next]
        self._next += 1
        return frame

    def _discard_rest(self):
        self._next = len(self._frames)

    def _send(self, frames, copy=True):
        """Send a message through the native thread, which owns the socket; large bodies go zero-copy."""
        token = None
        if not copy and len(frames[-1]) >= COPY_BELOW:
            token = next(self._tokens)
            self._zero_copy[token] = frames[-1]  # alive until the native thread says it is released
        if not self.core.send(frames, token) and token is not None:
            self._zero_copy.pop(token, None)

    def _reply_error(self, ident, header, msg):
        body = wire.encode({"error": msg})
        self._send([ident, wire.pack(Cmd.ERROR, sender=self.control.node_id, key=header.key, round=header.round,
                                     length=len(body)), body])

    def _on_probe(self, ident, header):
        """PROBE from an authenticated worker: echo its body, so it can time the link (byteps/autotune.py)."""
        body = self._take() if self._more() else b""
        self._discard_rest()
        self._send([ident, wire.pack(Cmd.PROBE, sender=self.control.node_id, key=header.key, round=header.round,
                                     length=len(body)), body], copy=False)

    def _on_link(self, ident):
        """LINK from an authenticated worker: a one-time token for a direct TCP link (core/transport/bps_link.h),
        or why not (the worker then stays on ZeroMQ)."""
        self._discard_rest()
        if self.link_port is None and self.ucx_port is None:
            answer = {"error": f"this server cannot listen for direct links on {self.cfg.node_host}"}
        else:
            token = os.urandom(transport.TOKEN_BYTES)  # one use, on a TCP link or a UCX endpoint
            self.core.expect_link(ident, token)  # queued before the answer below: the token is known first
            answer = {"port": self.link_port, "token": token.hex()}
            if self.ucx_port is not None:
                answer["ucx_port"] = self.ucx_port
        self._send([ident] + wire.control(Cmd.LINK, self.control.node_id, answer))

    def _handle(self, frames):
        """One data-plane message the native thread forwarded; True."""
        self._frames, self._next = frames, 2
        if len(frames) < 2:
            return True
        ident, raw = frames[0], frames[1]
        try:
            header = wire.unpack(raw)
            if header.cmd in (Cmd.HELLO, Cmd.AUTH):
                self._on_handshake(ident, header)
                return True
            if not self.gate.allows(ident):
                self._discard_rest()
                if ident not in self.gate.refused:
                    self.gate.refused.add(ident)
                    logger.warning("ignored data from an unauthenticated peer %r (it never proved it knows "
                                   "BYTEPS_JOB_SECRET)", ident)
                return True
            if header.cmd == Cmd.PROBE:
                self._on_probe(ident, header)
                return True
            if header.cmd == Cmd.LINK:
                self._on_link(ident)
                return True
            if header.cmd == Cmd.RESULT:  # only the native thread takes over a lost server's rounds
                self._discard_rest()
                logger.warning("dropped a worker's RESULT of key %s round %d: this server's Python loop does not take "
                               "over a lost server's keys (docs/elastic.md)", wire.split_key(header.key), header.round)
                return True
            if header.cmd not in (Cmd.PUSHPULL, Cmd.BROADCAST, Cmd.ASYNC_PUSHPULL):
                raise ProtocolError(f"{Cmd(header.cmd).name} is not a data request")
            if self.num_workers is None:
                raise ProtocolError("data arrived before the address book")
            if not self._more():
                raise ProtocolError("data request without a body frame")
        except ProtocolError as e:
            self._discard_rest()
            logger.warning("rejected a malformed data message: %s", e)
            return True
        rank = self.ranks.get(header.sender, f"node {header.sender}")
        # before any state exists for the key: an unknown dtype code must not become the key's dtype,
        # and a length that is not whole elements must not reach the sum kernels (both found by fuzzing)
        if header.dtype not in dtypes.INFO or header.length % dtypes.itemsize(header.dtype):
            self._discard_rest()
            self._reply_error(ident, header, f"key {wire.split_key(header.key)}: rank {rank} sent {header.length} "
                                             f"bytes of dtype code {header.dtype}: not whole elements of a known dtype")
            return True
        if self.joined and header.cmd == Cmd.BROADCAST and self._set_pushers(header) is None:
            # as in Horovod: not while ranks have joined (join() is the whole job's, not a process set's)
            self._discard_rest()
            self._reply_error(ident, header, self._joined_broadcast_error())
            return True
        st = self.keys.get(header.key)
        if st is None:
            # a broadcast's size is known only from the root's message
            size = header.length if header.cmd != Cmd.BROADCAST else None
            st = self.keys[header.key] = _Round(size, header.dtype, self.alloc)
            st.key = header.key
            if self.cfg.elastic:  # a key taken over from a lost server goes on in the round it was in
                st.round = header.round
        if header.cmd == Cmd.ASYNC_PUSHPULL:  # the native core serves them all (summation/native/async_rounds.h)
            self._discard_rest()
            self._reply_error(ident, header, f"key {wire.split_key(header.key)}: an asynchronous push_pull of a key "
                                             "this server's Python rounds hold (compressed pushes)")
            return True
        if not st.senders:
            st.since = time.monotonic()
        received = time.monotonic_ns() if timeline.recorder is not None else 0
        problem = st.error or self._check(st, header, rank)
        if problem is None:
            problem = self._accept(st, header, rank, ident)
        else:
            self._discard_rest()
        if problem is not None and st.error is None:
            st.error = problem
        st.senders.append(rank)
        st.waiters.append((ident, header.flags & wire.FLAG_SHM))
        st.header = header
        if received:
            timeline.span("RECV", received, header.key, header.round, header.length,
                          peer=rank if isinstance(rank, int) else -1)
        if len(st.senders) >= self._expected(header):
            self._maybe_complete(st, header)
        return True

    def _on_handshake(self, ident, header):
        try:
            body = wire.decode(self._take()) if self._more() else {}
        except ProtocolError:
            body = {}
        self._discard_rest()
        if self.gate.secret is None:
            if header.cmd == Cmd.HELLO:  # say why at once rather than let the worker time out
                self._send([ident] + wire.control(Cmd.ERROR, self.control.node_id, {
                    "error": "this server has no BYTEPS_JOB_SECRET but the worker uses one"}))
            return
        if header.cmd == Cmd.HELLO:
            self._send([ident] + wire.control(Cmd.CHALLENGE, self.control.node_id, self.gate.challenge(ident, body)))
        elif not self.gate.check(ident, body.get("mac")):
            logger.warning("refused worker connection %r: authentication failed", ident)

    # The synchronous rounds below serve only the keys the native core forwards: pushes marked FLAG_PYTHON
    # (FLAG_PYTHON) and keys handed over mid-round (_take_handover); it runs the rest.

    def _check(self, st, h, rank):
        """Why this message cannot join the round, or None (messages are built only on error)."""
        if h.round != st.round:
            return f"{_name(h)}: rank {rank} sent round {h.round} while the server is at round {st.round}"
        if rank in st.senders:
            return f"{_name(h)}: rank {rank} sent round {h.round} twice"
        if h.dtype not in dtypes.INFO:
            return f"{_name(h)}: rank {rank} sent unknown dtype code {h.dtype}"
        if h.cmd == Cmd.BROADCAST:
            if st.root is not None and h.arg != st.root:
                return (f"{_name(h)}: broadcast root differs across workers: rank {st.first[0]} names root "
                        f"{st.root}, rank {rank} names root {h.arg}")
            if h.arg != rank and h.length != 0:
                return f"{_name(h)}: non-root rank {rank} sent {h.length} bytes with a broadcast"
            return None
        if st.first is not None:
            who, nbytes, dtype = st.first
        else:
            who, nbytes, dtype = f"in round {st.round - 1}, every rank", st.nbytes, st.dtype
        if h.length != nbytes or h.dtype != dtype:
            return (f"{_name(h)}: rank {rank} pushed {h.length} bytes of {dtypes.name(h.dtype)} but rank {who} "
                    f"pushed {nbytes} bytes of {dtypes.name(dtype)}")
        return None

    def _accept(self, st, h, rank, ident):
        """Take the body into the store; return an error message if the body is not what the header said."""
        if st.first is None:
            st.first = (rank, h.length, h.dtype)
        if h.cmd == Cmd.BROADCAST:
            st.root = h.arg
            if h.arg != rank:
                self._discard_rest()
                return None
            st.root_ident = ident
            if st.nbytes != h.length or st.dtype != h.dtype:  # new stores at first use (_Round.stores)
                st.nbytes, st.dtype, st._stores, st._shared = h.length, h.dtype, None, None
        if h.flags & wire.FLAG_COMPRESSED:  # the native thread sums every compressed push
            self._discard_rest()
            return f"{_name(h)}: rank {rank} sent a compressed push marked FLAG_PYTHON; only the native rounds take those"
        if h.flags & wire.FLAG_SHM:
            body = self._take()
            try:
                src = self.maps.view(body)
            except ProtocolError as e:
                self._discard_rest()
                return f"key {wire.split_key(h.key)}: rank {rank}'s shared memory: {e}"
            got = src.size
            if got == h.length and h.cmd == Cmd.PUSHPULL and self._expected(h) == 1:
                st.echo = body  # one machine: answer with its own region, no copy
            elif got == h.length and h.cmd == Cmd.BROADCAST:
                copy_into(st.store, src)
            elif got == h.length:
                self._add(st, src, src, h.dtype)
        elif h.cmd == Cmd.BROADCAST:
            frame = self._take()
            got = len(frame)
            if got == h.length:  # the store is allocated only for a body of the announced size
                copy_into(st.store, frame)
        else:
            frame = self._take()
            got = len(frame)
            if got == h.length:
                self._add(st, frame, frame, h.dtype)
        self._discard_rest()
        if got != h.length:
            return f"key {wire.split_key(h.key)}: rank {rank}'s header says {h.length} bytes but {got} arrived"
        return None

    def _add(self, st, keep, data, dtype):
        """Fold one push into the round. The first is only held (its shared region or zmq frame stays
        valid until the round's replies); the second makes store = first + second in one pass
        (sum_many: 3 buffers of traffic instead of a copy then a sum, 5); later ones add in place."""
        store = st.store
        if st.senders == [] and st.held is None:
            st.held = (keep, data)
        elif st.held is not None:
            first, st.held = st.held, None
            self._sum(st, lambda: sum_many(store, [first[1], data], dtype), first, keep)
        else:
            self._sum(st, lambda: sum_into(store, data, dtype), keep)

    def _sum(self, st, fn, *keep):
        """Run a summation into the round's store: inline, or on the key's engine thread (the closure
        keeps the pushes' frames or shared views alive until it has run)."""
        if self.pool.threads <= 0:
            fn()
            return
        st.pending += 1
        self.pool.submit(st.key, fn)

    def _on_summed(self):
        """Engine threads finished sums: complete the rounds that were waiting only for them."""
        self.pool.drain_wakeups()
        while self.pool.done:
            key, error = self.pool.done.popleft()
            st = self.keys.get(key)
            if st is None:
                continue
            st.pending -= 1
            if error is not None and st.error is None:
                st.error = f"key {wire.split_key(key)}: summation failed: {error!r}"
            if st.pending == 0 and st.ready is not None:
                h, st.ready = st.ready, None
                self._complete(st, h)

    def _maybe_complete(self, st, h):
        if st.pending:
            st.ready = h  # _on_summed completes it
            return
        self._complete(st, h)

    def _complete(self, st, h):
        node = self.control.node_id
        replying = time.monotonic_ns() if timeline.recorder is not None else 0
        if replying:
            timeline.span("ROUND", int(st.since * 1e9), h.key, st.round, h.length)
        if st.error is None and h.cmd == Cmd.BROADCAST and st.root_ident is None:
            st.error = f"key {wire.split_key(h.key)}: broadcast root rank {st.root} never sent its data"
        if st.error is None and st.held is not None:  # a lone push: the sum is that push
            copy_into(st.store, st.held[1])
        st.held = None
        if st.error is not None:
            logger.warning("%s", st.error)
            for ident, _ in st.waiters:
                self._reply_error(ident, h, st.error)
        else:
            store = st.store
            for ident, shared in st.waiters:
                flags = 0
                if h.cmd == Cmd.BROADCAST and ident == st.root_ident:
                    body = b""  # the broadcast root already has the data
                elif st.echo is not None:
                    body, flags = st.echo, wire.FLAG_SHM
                elif shared:
                    body, flags = st.store_descriptor(), wire.FLAG_SHM  # the worker copies from our store
                else:
                    body = store
                self._send([ident, wire.pack(Cmd.REPLY, sender=node, key=h.key, round=st.round, length=st.nbytes
                                             if flags else len(body), dtype=st.dtype, flags=flags), body], copy=False)
        if replying:
            timeline.span("REPLY", replying, h.key, st.round, h.length, peer=len(st.waiters))
        st.round += 1
        st.reset()

    def _warn_stalls(self, now):
        for key, st in self.keys.items():
            if st.senders and not st.warned and now - st.since > STALL_WARNING_S:
                logger.warning("key %s round %d has waited %.0f s: pushes from ranks %s are in, %d expected",
                               wire.split_key(key), st.round, now - st.since, st.senders, self.pushers)
                st.warned = True

    # ---------------------------------------------------------------- loop

    def run(self):
        self.control.register()
        poller = self.poller = zmq.Poller()
        poller.register(self.control.sock, zmq.POLLIN)
        if self.pool.fd is not None:
            poller.register(self.pool.fd, zmq.POLLIN)
        tick_ms = min(self.cfg.heartbeat_interval, 1.0) * 1000
        next_check = 0.0
        while True:
            events = dict(poller.poll(timeout=tick_ms))
            if self.control.sock in events:
                code = self._on_control()
                if code is not None:
                    logger.info("job complete; server exiting")
                    return code
            if self.pool.fd in events:
                self._on_summed()
            if self.core is not None and self.core.notify_fd in events:
                self._on_native()
            self.control.tick()
            now = time.monotonic()
            if now >= next_check:  # walks every key: not once per message
                self._warn_stalls(now)
                if timeline.recorder is not None:  # no steps here: send spans every few seconds
                    timeline.recorder.flush_due |= now - timeline.recorder.last_sent > SERVER_FLUSH_S
                    timeline.flush(self.control)
                next_check = now + 1.0

    def close(self):
        self.pool.close()
        core = self.core
        if core is not None:
            timeline.remember_threads()  # byteps-serve and byteps-sum-i, before they end
            core.stop()  # before the socket it owns is closed
            for line in core.logs():  # its last warnings
                logger.warning("%s", line)
            stats = core.stats()
            logger.info("native data plane: %d pushes handled on byteps-serve, %d rounds completed, %d messages "
                        "forwarded to Python", stats["pushes"], stats["rounds"], stats["forwarded"])
            if self.ucx_port is not None:
                logger.info("UCX registrations: %d receive buffers and store arenas mapped (ucp_mem_map), %d "
                            "transfers passed one", *_server_core.ucx_registrations())
        self.data.close(linger=1000)
        timeline.flush(self.control, final=True)  # after byteps-serve stopped: its last spans are in
        self.control.close()
        self.maps.close()
        # replies are sent zero-copy from the stores: let ZeroMQ's I/O thread finish with them (at
        # most the linger above) before the interpreter frees them at exit, or it aborts on a send
        # from freed memory ("Bad address (src/tcp.cpp)"; found by tests/test_stress.py)
        self.ctx.term()
        self.core = None  # its stores are unmapped now that ZeroMQ has released every reply
        self._zero_copy.clear()


def main():
    return service.main("server", Server)
