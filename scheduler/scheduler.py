"""Scheduler event loop.

One ROUTER socket at DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT serves every node's DEALER. The handlers of
each phase live in their own module: registration and epochs (registration.py), barriers and tensor
declarations (declarations.py, stalls.py), Horovod's join() (join.py), elastic servers (elastic.py);
heartbeats both ways are here. A node silent for BYTEPS_HEARTBEAT_TIMEOUT is declared lost: every
other node gets ABORT naming it, and the scheduler exits 1 (with BYTEPS_ELASTIC=1 a lost server that
is not the last one is removed instead).
"""
import os
import signal
import time

import zmq

from byteps import port_file, service
from byteps.core import auth, wire
from byteps.core.control import describe_node
from byteps.errors import BytePSError, ConfigError, ProtocolError
from byteps.log import logger
from byteps.timeline.trace import Collector

from .declarations import Declarations
from .elastic import ElasticServers
from .join import Join
from .registration import Registration

Cmd = wire.Cmd
SCHEDULER_ID = 0xFFFFFFFE


class JobFailed(BytePSError):
    pass


class Scheduler(Registration, Declarations, Join, ElasticServers):
    """The scheduler's state and loop; the handlers of each phase live in the base class of its module."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer raises instead of vanishing
        if cfg.root_port == 0:
            self.port = self.sock.bind_to_random_port(f"tcp://{cfg.root_uri}")
        else:
            try:
                self.sock.bind(f"tcp://{cfg.root_uri}:{cfg.root_port}")
            except zmq.ZMQError as e:
                raise ConfigError(f"scheduler cannot bind DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT = "
                                  f"{cfg.root_uri}:{cfg.root_port}: {e}") from None
            self.port = cfg.root_port
        self.gate = auth.Gate(auth.job_secret())
        self.epoch = 0
        self.servers = {}         # identity -> info (registered, stays across epochs)
        self.workers = {}         # identity -> info, this epoch's registrations
        self.running = False      # address book sent for this epoch
        self.last_seen = {}       # identity -> monotonic time of last message
        self.left = set()         # worker identities that sent LEAVE this epoch
        self.book = None          # the running epoch's address book (servers change with elastic servers)
        self.local_reduce = False
        self._init_registration()
        self._init_declarations()
        self._init_join()
        self._init_elastic()
        # the job timeline (BYTEPS_TIMELINE, or a worker's start_timeline(path)): every node's spans
        self.timeline = Collector(cfg.timeline)

    # ---------------------------------------------------------------- helpers

    def _send(self, ident, cmd, body=None, arg=0):
        try:
            self.sock.send_multipart([ident] + wire.control(cmd, SCHEDULER_ID, body, arg=arg))
        except zmq.ZMQError as e:  # EHOSTUNREACH: that peer is gone; its heartbeat loss will be reported
            logger.debug("send %s to %r failed: %s", Cmd(cmd).name, ident, e)

    def _nodes(self):
        return {**self.servers, **self.workers}

    def _fail(self, reason):
        logger.error("job failed: %s", reason)
        for ident in self._nodes():
            self._send(ident, Cmd.ABORT, {"reason": reason})
        if not self.running:
            self._refuse_stragglers(reason)
        raise JobFailed(reason)

    def _refuse_stragglers(self, reason, seconds=2.0):
        """A job that fails at start-up: nodes still registering get the reason at once, instead of
        waiting BYTEPS_TIMEOUT for a scheduler that has gone."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(left * 1000):
                break
            frames = self.sock.recv_multipart()
            if len(frames) == 3:
                self._send(frames[0], Cmd.ERROR, {"error": f"the job failed at start-up: {reason}"})

    def _active_workers(self):
        return [i for i in self.workers if i not in self.left]

    def _describe(self, ident):
        node = self._nodes()[ident]
        if "rank" in node or "index" in node:
            return describe_node(node)
        return f"{node.get('role')} (pid {node.get('pid')} on {node.get('hostname')}, not yet ranked)"

    # ---------------------------------------------------------------- timeouts

    def _check_timeouts(self):
        now = time.monotonic()
        for ident, seen in list(self.last_seen.items()):
            if ident not in self._nodes() or ident in self.left:
                continue
            if now - seen > self.cfg.heartbeat_timeout:
                reason = (f"lost {self._describe(ident)}: no heartbeat for {now - seen:.1f} s (BYTEPS_HEARTBEAT_TIMEOUT="
                          f"{self.cfg.heartbeat_timeout:g})")
                if ident in self.servers and self._can_lose(ident):
                    self._lose_server(ident, reason)
                    continue
                self._fail(reason)
        self._check_change(now)
        self._check_startup(now)
        self._expire_waits(now)

    # ---------------------------------------------------------------- loop

    def run(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        last_beat = 0.0
        tick = min(self.cfg.heartbeat_interval, 1.0)
        while True:
            backlog = False
            if poller.poll(timeout=tick * 1000):
                # drain in slices of at most 50 ms: a burst (10,000 declarations) must not delay
                # our heartbeats, and nobody is judged lost while its messages are still queued
                until = time.monotonic() + 0.05
                while True:
                    self._dispatch(self.sock.recv_multipart())
                    if not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    if time.monotonic() > until:
                        backlog = True
                        break
            now = time.monotonic()
            if now - last_beat >= self.cfg.heartbeat_interval:
                for ident in self._nodes():
                    self._send(ident, Cmd.HEARTBEAT)
                last_beat = now
            if not backlog:
                self._check_timeouts()
            if self._job_complete():
                logger.info("job complete: every worker process exited")
            elif self.idle_since is not None and now - self.idle_since > self.cfg.timeout:
                logger.warning("every worker called shutdown() but not every worker process reported its exit "
                               "within %g s (BYTEPS_TIMEOUT); ending the job", self.cfg.timeout)
            else:
                continue
            for s in self.servers:
                self._send(s, Cmd.TERMINATE)
            return 0

    def _dispatch(self, frames):
        arrived = time.monotonic_ns()  # a clock probe's t1: before any work on the message
        if len(frames) != 3:
            logger.warning("dropped a message with %d frames", len(frames))
            return
        ident, raw_header, raw_body = frames
        try:
            header = wire.unpack(raw_header)
            body = wire.decode(raw_body)
        except ProtocolError as e:
            self.gate.refusals.warning("dropped a malformed control message: %s", e)
            return
        if header.cmd == Cmd.HELLO:
            if self.gate.secret is None:
                self._send(ident, Cmd.ERROR, {"error": "this scheduler has no BYTEPS_JOB_SECRET but the node uses one"})
            else:
                self._send(ident, Cmd.CHALLENGE, self.gate.challenge(ident, body))
            return
        if header.cmd in (Cmd.REGISTER, Cmd.EXIT) and self.gate.secret is not None \
                and not self.gate.check(ident, body.get("auth")):
            self.gate.refusals.warning("refused %s from pid %s on %s: authentication failed (wrong or missing "
                                       "BYTEPS_JOB_SECRET)", Cmd(header.cmd).name, body.get("pid"), body.get("hostname"))
            self._send(ident, Cmd.ERROR, {"error": "authentication failed: this node's BYTEPS_JOB_SECRET does not "
                                                   "match the scheduler's"})
            return
        if header.cmd == Cmd.REGISTER:
            self._on_register(ident, body)
            return
        if header.cmd == Cmd.EXIT:
            self._on_exit(body)
            return
        if header.cmd == Cmd.TRACE:  # also after the sender's epoch ended (its last spans come then)
            self._on_trace(ident, body)
            return
        if ident not in self._nodes():
            logger.debug("message %s from an unregistered peer ignored", Cmd(header.cmd).name)
            return
        now = time.monotonic()
        gap = now - self.last_seen.get(ident, now)
        if gap > self.cfg.heartbeat_timeout / 2:  # early warning of a node about to be declared lost
            logger.warning("%s was silent for %.1f s (BYTEPS_HEARTBEAT_TIMEOUT=%g)", self._describe(ident), gap,
                           self.cfg.heartbeat_timeout)
        self.last_seen[ident] = now
        if header.cmd == Cmd.HEARTBEAT:
            return
        if header.cmd == Cmd.CLOCK:  # a timestamped round trip (byteps/timeline Clock)
            self._send(ident, Cmd.CLOCK, {"t0": body.get("t0", 0), "t1": arrived, "t2": time.monotonic_ns()})
            return
        if header.cmd == Cmd.BARRIER:
            self._on_barrier(ident, body)
        elif header.cmd == Cmd.DECLARE and ident in self.servers:
            self._on_server_declared(ident, body)
        elif header.cmd == Cmd.DECLARE:
            self._on_declare(ident, body)
        elif header.cmd == Cmd.LEAVE:
            self._on_leave(ident)
        elif header.cmd == Cmd.ADDRBOOK and self.change is not None and ident in self.change.get("admitting", ()):
            self._on_admitted(ident)
        elif header.cmd == Cmd.ADDRBOOK:
            self._on_server_ready(ident, body)
        elif header.cmd == Cmd.MEMBERS:
            self._on_prepared(ident, body)
        elif header.cmd == Cmd.SUSPECT:
            self._on_suspect(ident, body)
        elif header.cmd == Cmd.JOIN and ident in self.servers:
            self._maybe_release_join(ident)
        elif header.cmd == Cmd.JOIN:
            self._on_join(ident)
        elif header.cmd == Cmd.ABORT:
            self._fail(f"{self._describe(ident)} aborted the job: {body.get('reason')}")
        else:
            logger.warning("unexpected %s from %r", Cmd(header.cmd).name, ident)

    # ---------------------------------------------------------------- the job timeline

    def _on_trace(self, ident, body):
        had_path = bool(self.timeline.path)
        if not self.timeline.add(ident, body):
            logger.debug("TRACE from a peer that is not in the job ignored")
            return
        if not had_path and self.timeline.path:  # start_timeline(path) on one worker: every node records
            for other in self._nodes():
                if other != ident:
                    self._send(other, Cmd.TRACE, {"start": self.timeline.path})
        if body.get("final") and not self.cfg.timeline and self.timeline.path:
            self.write_timeline()  # stop_timeline(): a snapshot now; the end of the job writes it again

    def finish_timeline(self, grace):
        """At the end of the job (or its failure): wait up to ``grace`` seconds for the last spans of
        every node still alive, then write the trace. A node that died loses only what it had not sent."""
        if not self.timeline.path:
            return
        deadline = time.monotonic() + grace
        while True:
            now = time.monotonic()
            alive = [i for i in self.timeline.known
                     if now - self.last_seen.get(i, now) < self.cfg.heartbeat_timeout]
            missing = self.timeline.missing_finals(alive)
            if not missing or now >= deadline:
                break
            if self.sock.poll(min(100, (deadline - now) * 1000)):
                frames = self.sock.recv_multipart()
                try:
                    is_trace = len(frames) == 3 and wire.unpack(frames[1]).cmd == Cmd.TRACE
                except ProtocolError:
                    is_trace = False
                if is_trace:
                    self._dispatch(frames)
        if missing:
            logger.warning("timeline: no final spans from %d nodes within %g s; writing what arrived", len(missing),
                           grace)
        self.write_timeline()

    def write_timeline(self):
        try:
            path = self.timeline.write()
        except OSError as e:
            logger.error("timeline: cannot write %s: %s", self.timeline.path, e)
            return
        if path:
            logger.info("timeline of %d nodes written to %s", len(self.timeline.nodes), path)

    def close(self):
        self.sock.close(linger=2000)


def main():
    return service.main("scheduler", _Service)


class _Service:
    """The scheduler as ``python -m byteps.scheduler`` runs it: the port file bpslaunch waits for,
    and the job timeline written at the end, also when bpslaunch stops a failed job with SIGTERM."""

    def __init__(self, cfg):
        self.sched = Scheduler(cfg)
        self.grace = min(10.0, cfg.timeout)  # for the nodes' last spans
        path = os.environ.get("BYTEPS_SCHEDULER_PORT_FILE")
        if path:
            port_file.write(path, self.sched.port)
        logger.info("listening on %s:%d for %d workers and %d servers", cfg.root_uri, self.sched.port,
                    cfg.num_worker, cfg.num_server)
        if self.sched.timeline.path:
            signal.signal(signal.SIGTERM, _terminated)

    def run(self):
        try:
            return self.sched.run()
        except JobFailed:  # said already, to every node and in the log
            return service.EXIT_FAILED
        except Terminated:
            self.grace = 0.0  # the nodes are being stopped too: write at once
            return 143

    def close(self):
        try:
            self.sched.finish_timeline(self.grace)
        finally:
            self.sched.close()


class Terminated(Exception):
    pass


def _terminated(signum, frame):
    raise Terminated()
