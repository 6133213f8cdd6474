"""Summation Service server: the control plane, and the hand-over of the data socket to the native core.

Data plane: one ROUTER socket on DMLC_NODE_HOST (random port, announced to the scheduler). Once the
first address book has arrived it belongs to the thread "byteps-serve" (summation/native/bps_server.h,
through summation/_server_core.pyx), which receives, checks, sums and answers every push without the
GIL (plain, shared-memory, compressed, asynchronous and process sets' rounds). This loop keeps the
control plane (address book, join(), process sets' keys, LEAVE, the timeline) and answers what the
native thread forwards: handshakes (core/auth.py), strangers, PROBE, LINK and malformed data
messages, its replies going out through the native thread, which alone touches the socket.
"""
import itertools
import os
import time

import zmq

from byteps import placement, service, timeline
from byteps.core import auth, shm, transport, wire
from byteps.core._reduce import get_num_threads
from byteps.core.control import ControlClient
from byteps.errors import BytePSError, PeerLostError, ProtocolError
from byteps.log import logger

from . import _server_core

Cmd = wire.Cmd
#: a server has no steps: it sends its spans to the scheduler this often while tracing
SERVER_FLUSH_S = 5.0


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
        self.gate = auth.Gate(auth.job_secret())  # workers prove they know the job's secret first
        if cfg.timeline:
            timeline.start(cfg)
        self.control = ControlClient(self.ctx, cfg, info)
        self.num_workers = None
        self.pushers = None
        self.ranks = {}          # node id -> rank, from the address book
        self.index = None
        self.epoch = None
        if not _server_core.available:
            raise BytePSError(f"the native server core cannot run here: {_server_core.unavailable_reason}")
        self.poller = zmq.Poller()
        self.poller.register(self.control.sock, zmq.POLLIN)
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
                self._start_timeline()
            if self.core is None:
                self._start_native()
            # before our answer: no push can arrive before the book
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
            if self.core is not None:  # before our answer: no member pushes before every server knows
                self.core.set_pushers(int(body["key"]), int(body["pushers"]))
            self.control.send(Cmd.DECLARE, {"key": body["key"]})
        elif header.cmd == Cmd.TRACE:  # a worker called start_timeline(): record too
            self._start_timeline()
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

    def _start_timeline(self):
        rec = timeline.start(self.cfg)
        rec.node.update(role="server", index=self.index, host=self.cfg.node_host)
        if self.core is not None:  # else _start_native adds it
            rec.add_native(_server_core.trace_buffer())

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
        if self.alloc is not None:
            self.alloc.reset()

    def _on_join(self, body):
        if body["done"]:  # everyone joined: a sync point, every key restarts at round 0
            if self.core is not None:
                self.core.set_join(True, (), None)
            self._reset_keys()
            # the scheduler releases the workers from join() only once every server has said this
            self.control.send(Cmd.JOIN, {"done": True})
        elif self.core is not None:  # it completes its own rounds that waited only for these ranks
            self.core.set_join(False, tuple(body["joined"]), body["pushers"])

    # ---------------------------------------------------------------- native data plane

    def _start_native(self):
        """Hand the data socket to the native thread byteps-serve (summation/native/bps_server.h). Python never reads it:
        workers learn its address from the same address book, so nothing arrives before this."""
        core = _server_core.ServerCore(self.data, self.gate.secret is not None, self.alloc is not None,
                                       self.cfg.server_engine_threads, get_num_threads())
        core.set_adopt_rounds(self.cfg.elastic)
        core.set_async(self.cfg.enable_async)
        try:  # workers' direct links (core/transport/bps_link.h): all their partitions come on them
            fd, self.link_port = transport.listen_link(self.cfg.node_host)
        except OSError as e:
            raise BytePSError(f"this server cannot listen for workers' direct links on {self.cfg.node_host}: {e}") \
                from None
        core.set_listener(fd)
        self.ucx_port = self._ucx_listen(core)
        for ident in self.gate.admitted():
            core.admit(ident, True)
        if timeline.recorder is not None:
            timeline.recorder.add_native(_server_core.trace_buffer())
        core.start()
        self.core = core
        self.poller.register(core.notify_fd, zmq.POLLIN)
        logger.info("native data plane: pushes received, summed and answered on thread byteps-serve "
                    "(%s)", f"{self.cfg.server_engine_threads} sum threads" if self.cfg.server_engine_threads
                    else "sums inline")

    def _ucx_listen(self, core):
        """A UCX listener for workers' endpoints (core/transport/bps_ucx.h) when this server's transport is UCX:
        its port, or None (workers then use TCP links)."""
        from byteps.core import ucx
        if ucx.choose(self.cfg.transport, _server_core) != "ucx":
            return None
        try:
            return core.ucx_listen(self.cfg.node_host)
        except RuntimeError as e:
            logger.warning("no UCX listener on %s (%s): workers' links to this server are TCP",
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
        for frames, auth_pending in self.core.forwarded():
            try:
                self._handle(frames)
            finally:
                if auth_pending:  # the native thread holds this identity's later messages until it knows
                    self.core.admit(frames[0], self.gate.allows(frames[0]))

    # ---------------------------------------------------------------- data plane

    def _send(self, frames, copy=True):
        """Send a message through the native thread, which owns the socket; large bodies go zero-copy
        (smaller ones are cheaper to copy)."""
        token = None
        if not copy and len(frames[-1]) >= _server_core.ZERO_COPY_MIN:
            token = next(self._tokens)
            self._zero_copy[token] = frames[-1]  # alive until the native thread says it is released
        if not self.core.send(frames, token) and token is not None:
            self._zero_copy.pop(token, None)

    def _on_probe(self, ident, header, body):
        """PROBE from an authenticated worker: echo its body, so it can time the link (byteps/autotune.py)."""
        self._send([ident, wire.pack(Cmd.PROBE, sender=self.control.node_id, key=header.key, round=header.round,
                                     length=len(body)), body], copy=False)

    def _on_link(self, ident):
        """LINK from an authenticated worker: a one-time token for a direct link (core/transport/bps_link.h,
        or a UCX endpoint where this server listens for them)."""
        token = os.urandom(transport.TOKEN_BYTES)  # one use, on a TCP link or a UCX endpoint
        self.core.expect_link(ident, token)  # queued before the answer below: the token is known first
        answer = {"port": self.link_port, "token": token.hex()}
        if self.ucx_port is not None:
            answer["ucx_port"] = self.ucx_port
        self._send([ident] + wire.control(Cmd.LINK, self.control.node_id, answer))

    def _handle(self, frames):
        """One data-plane message the native thread forwarded: [identity, header, body...]."""
        if len(frames) < 2:
            return
        ident, raw = frames[0], frames[1]
        body = frames[2] if len(frames) > 2 else b""
        try:
            header = wire.unpack(raw)
            if header.cmd in (Cmd.HELLO, Cmd.AUTH):
                self._on_handshake(ident, header, body)
                return
            if not self.gate.allows(ident):
                self.gate.refusals.warning("ignored data from an unauthenticated peer %r (it never proved it knows "
                                           "BYTEPS_JOB_SECRET)", ident)
                return
            if header.cmd == Cmd.PROBE:
                self._on_probe(ident, header, body)
                return
            if header.cmd == Cmd.LINK:
                self._on_link(ident)
                return
            if header.cmd == Cmd.RESULT:  # only the native thread takes over a lost server's rounds
                logger.warning("dropped a worker's RESULT of key %s round %d: this server's Python loop does not take "
                               "over a lost server's keys (docs/elastic.md)", wire.split_key(header.key), header.round)
                return
            if header.cmd not in (Cmd.PUSHPULL, Cmd.BROADCAST, Cmd.ASYNC_PUSHPULL):
                raise ProtocolError(f"{Cmd(header.cmd).name} is not a data request")
        except ProtocolError as e:
            self.gate.refusals.warning("rejected a malformed data message: %s", e)
            return
        # the native thread sums every well-formed push: what comes here cannot join a round
        rank = self.ranks.get(header.sender, f"node {header.sender}")
        why = ("before the address book" if self.num_workers is None else
               "without its body frame" if len(frames) < 3 else "that is malformed")
        msg = f"key {wire.split_key(header.key)}: rank {rank} sent a {Cmd(header.cmd).name} {why}"
        self.gate.refusals.warning("rejected a data message: %s", msg)
        error = wire.encode({"error": msg})
        self._send([ident, wire.pack(Cmd.ERROR, sender=self.control.node_id, key=header.key, round=header.round,
                                     length=len(error)), error])

    def _on_handshake(self, ident, header, raw):
        try:
            body = wire.decode(raw) if raw else {}
        except ProtocolError:
            body = {}
        if self.gate.secret is None:
            if header.cmd == Cmd.HELLO:  # say why at once rather than let the worker time out
                self._send([ident] + wire.control(Cmd.ERROR, self.control.node_id, {
                    "error": "this server has no BYTEPS_JOB_SECRET but the worker uses one"}))
            return
        if header.cmd == Cmd.HELLO:
            self._send([ident] + wire.control(Cmd.CHALLENGE, self.control.node_id, self.gate.challenge(ident, body)))
        elif not self.gate.check(ident, body.get("mac")):
            self.gate.refusals.warning("refused worker connection %r: authentication failed", ident)

    # ---------------------------------------------------------------- loop

    def run(self):
        self.control.register()
        tick_ms = min(self.cfg.heartbeat_interval, 1.0) * 1000
        next_check = 0.0
        while True:
            events = dict(self.poller.poll(timeout=tick_ms))
            if self.control.sock in events:
                code = self._on_control()
                if code is not None:
                    logger.info("job complete; server exiting")
                    return code
            if self.core is not None and self.core.notify_fd in events:
                self._on_native()
            self.control.tick()
            now = time.monotonic()
            if now >= next_check:
                if timeline.recorder is not None:  # no steps here: send spans every few seconds
                    timeline.recorder.flush_due |= now - timeline.recorder.last_sent > SERVER_FLUSH_S
                    timeline.flush(self.control)
                next_check = now + 1.0

    def close(self):
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
        # replies are sent zero-copy from the stores: ZeroMQ's I/O thread must finish with them (at most
        # the linger above) before they are freed, or it aborts on a send from freed memory
        self.ctx.term()
        self.core = None  # its stores are unmapped now that ZeroMQ has released every reply
        self._zero_copy.clear()


def main():
    return service.main("server", Server)
