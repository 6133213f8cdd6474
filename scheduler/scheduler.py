"""Scheduler event loop.

One ROUTER socket at DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT serves every node's DEALER. Phases:

1. Registration: servers and worker processes send REGISTER. When DMLC_NUM_SERVER servers and,
   for every DMLC_WORKER_ID, all of its BYTEPS_LOCAL_SIZE processes are in, ranks are assigned
   (workers sorted by (worker id, local rank); servers by (host, port)) and every node gets the
   address book: servers first, workers once every server has acknowledged it, so no push can
   reach a server before it knows the epoch's workers. Nodes still missing after BYTEPS_TIMEOUT are named in the error.
2. Running: barriers, tensor declarations (every worker declares each tensor name with its
   shape and dtype; when all have, the specs are compared and one key is handed out, or a
   mismatch error naming the ranks goes to all of them), heartbeats both ways.
3. An epoch ends when every worker has called shutdown() (LEAVE); workers may register again
   (init after shutdown) and servers drop their state. The job ends when every worker process
   has sent EXIT: servers are told to terminate and the scheduler exits 0.

Any node that goes silent for BYTEPS_HEARTBEAT_TIMEOUT is declared lost: every other node gets
ABORT naming it, and the scheduler exits 1.

With BYTEPS_ELASTIC=1 (docs/elastic.md) a lost server that is not the last one (silent, or a worker's
direct link to it broke: SUSPECT) is removed instead, and a server that registers while the job
runs is admitted. Each change is a new server membership, made in two steps: PREPARE tells every
worker the new servers (workers hold new ops and answer how many ops of each tensor they had
submitted); COMMIT hands them the cut, the largest count per tensor, from which every worker's ops
use the new membership. One change at a time; events that arrive meanwhile make the next one.
"""
import os
import signal
import time

import zmq

from byteps import service
from byteps.core import auth, wire
from byteps.core.control import describe_node
from byteps.errors import BytePSError, ConfigError, ProtocolError
from byteps.log import logger
from byteps.timeline.trace import Collector

from . import stalls

Cmd = wire.Cmd
SCHEDULER_ID = 0xFFFFFFFE
SERVER_ID_BASE = 1 << 20
STALL_GRACE_S = 3.0  # how long workers stand blocked in different collectives before they are failed  # server i has node id SERVER_ID_BASE + i; worker node id == rank


class JobFailed(BytePSError):
    pass


class Scheduler:
    def __init__(self, cfg, ctx=None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
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
        self.exited = set()       # (worker_id, local_rank) of worker processes that exited
        self.barriers = {}        # name -> set of identities
        # name -> (since, {rank: value}) of barriers whose members send a value (byteps/autotune.py's
        # partition-size agreement): the release hands every member all of them
        self.barrier_values = {}
        self.stall = None         # (signature, since) of waits that cannot end (stalls.py), while they stand
        self.declares = {}        # (name, spec json) ... see _on_declare
        self.set_declares = {}    # (name, seq, set id) -> declarations of a process set's tensor (_on_set_declare)
        self.keys = {}            # (name, spec) -> tensor key, stable for the whole job
        self.phase_start = time.monotonic()
        self.idle_since = None    # when every worker had left; bounded by BYTEPS_TIMEOUT
        self.total_workers = None  # worker processes in the job, known once the first epoch starts
        self._pending_book = None  # (book, workers, servers yet to acknowledge) while an epoch starts
        self.joined = []          # worker identities that called join(), in order (Horovod's join)
        self.missed = {}          # joined worker -> {(name, spec)} keyed while it was in join()
        self._join_release = None  # (JOIN body, servers yet to acknowledge) once every rank has joined
        self.book = None          # the running epoch's address book (servers change with elastic servers)
        self._set_keys_pending = {}  # process set key -> (its members' replies, servers yet to learn it)
        self.local_reduce = False
        # elastic servers (BYTEPS_ELASTIC=1, docs/elastic.md)
        self.members = 0          # server membership number, bumped by every change
        self.next_index = 0       # index of the next server admitted (indices are never reused)
        self.spares = {}          # identity -> info of elastic servers that registered before the job started
        self.changes = []         # queued events: ("lost" or "joined", the server's info, reason)
        self.change = None        # the change in progress: see _start_change
        self.ready = set()        # workers whose engine can take a change (MEMBERS "ready", after start-up)
        # the job timeline (BYTEPS_TIMELINE, or a worker's start_timeline(path)): every node's spans
        self.timeline = Collector(cfg.timeline)

    # ---------------------------------------------------------------- helpers

    def _send(self, ident, cmd, body=None, key=0, arg=0):
        try:
            self.sock.send_multipart([ident] + wire.control(cmd, SCHEDULER_ID, body, key=key, arg=arg))
        except zmq.ZMQError as e:  # EHOSTUNREACH: that peer is gone; its heartbeat loss will be reported
            logger.debug("send %s to %r failed: %s", Cmd(cmd).name, ident, e)

    def _nodes(self):
        return {**self.servers, **self.workers}

    def _local_sizes(self):
        sizes = {}
        for info in self.workers.values():
            sizes[info["worker_id"]] = info["local_size"]
        return sizes

    def _missing(self):
        """Names of the nodes that have not registered yet, for the startup-timeout message."""
        missing = []
        if len(self.servers) < self.cfg.num_server:
            missing.append(f"{self.cfg.num_server - len(self.servers)} of {self.cfg.num_server} servers")
        have = {(i["worker_id"], i["local_rank"]) for i in self.workers.values()}
        sizes = self._local_sizes()
        for wid in range(self.cfg.num_worker):
            if wid not in sizes:
                missing.append(f"worker DMLC_WORKER_ID={wid} (no process registered)")
                continue
            lost = [r for r in range(sizes[wid]) if (wid, r) not in have]
            if lost:
                missing.append(f"worker DMLC_WORKER_ID={wid} local ranks {lost}")
        return missing

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

    # ---------------------------------------------------------------- registration

    def _on_register(self, ident, body):
        role = body.get("role")
        if self.cfg.job_id and body.get("job_id") and body["job_id"] != self.cfg.job_id:
            self._send(ident, Cmd.ERROR, {"error": f"this scheduler serves job {self.cfg.job_id!r}, "
                                                   f"not {body['job_id']!r}"})
            logger.warning("refused a node of another job (%r)", body.get("job_id"))
            return
        if bool(body.get("enable_async", False)) != self.cfg.enable_async:
            # sync and async nodes cannot share a job: a server would sum where it should apply
            mode = {True: "BYTEPS_ENABLE_ASYNC=1 (asynchronous)", False: "BYTEPS_ENABLE_ASYNC=0 (synchronous)"}
            who = f"{role} {body.get('worker_id', '')} (pid {body.get('pid')} on {body.get('hostname')})"
            reason = (f"mixing synchronous and asynchronous nodes in one job: {who} has "
                      f"{mode[bool(body.get('enable_async'))]} but the scheduler has {mode[self.cfg.enable_async]}")
            self._send(ident, Cmd.ERROR, {"error": reason})
            if self.running:  # a stray node: refuse it, keep the running job
                logger.warning("refused a node: %s", reason)
                return
            self._fail(reason)  # the job cannot start without this node: fail now, naming it
        if role == "server":
            if self.epoch == 0 and not self.running and len(self.servers) < self.cfg.num_server:
                self.servers[ident] = dict(body)
            elif self.cfg.elastic and body.get("elastic"):
                self.last_seen[ident] = time.monotonic()
                logger.info("elastic server (pid %s on %s) registered: admitted %s", body.get("pid"),
                            body.get("hostname"), "now" if self.running else "once the job has started")
                if self.running:
                    self._admit(ident, dict(body))
                else:
                    self.spares[ident] = dict(body)
                return
            else:
                self._send(ident, Cmd.ERROR, {"error": f"all {self.cfg.num_server} servers (DMLC_NUM_SERVER) are "
                                                       "already registered"})
                return
        elif role == "worker":
            if self.running:
                self._send(ident, Cmd.ERROR, {"error": "the job is already running; a worker can join only when "
                                                       "every worker has called shutdown()"})
                return
            wid, lrank, lsize = body.get("worker_id"), body.get("local_rank"), body.get("local_size")
            if not (isinstance(wid, int) and 0 <= wid < self.cfg.num_worker):
                self._send(ident, Cmd.ERROR, {"error": f"DMLC_WORKER_ID={wid} is outside 0..{self.cfg.num_worker - 1}"
                                                       f" (the scheduler has DMLC_NUM_WORKER={self.cfg.num_worker})"})
                return
            for other in self.workers.values():
                if other["worker_id"] == wid and other["local_rank"] == lrank:
                    self._send(ident, Cmd.ERROR, {"error": f"a worker with DMLC_WORKER_ID={wid} and "
                                                           f"BYTEPS_LOCAL_RANK={lrank} is already registered "
                                                           f"(pid {other.get('pid')} on {other.get('hostname')})"})
                    return
                if other["worker_id"] == wid and other["local_size"] != lsize:
                    self._send(ident, Cmd.ERROR, {"error": f"DMLC_WORKER_ID={wid}: BYTEPS_LOCAL_SIZE={lsize} here "
                                                           f"but {other['local_size']} in pid {other.get('pid')}"})
                    return
            self.workers[ident] = dict(body)
        else:
            self._send(ident, Cmd.ERROR, {"error": f"unknown role {role!r}"})
            return
        self.last_seen[ident] = time.monotonic()
        logger.info("registered %s %s (pid %s on %s)", role, body.get("worker_id", ""), body.get("pid"),
                    body.get("hostname"))
        self._maybe_start()

    def _maybe_start(self):
        if self.running or len(self.servers) < self.cfg.num_server or self._missing():
            return
        servers = sorted(self.servers.items(), key=lambda kv: (kv[1]["host"], kv[1]["port"]))
        for index, (_, info) in enumerate(servers):
            info.update(index=index, node_id=SERVER_ID_BASE + index, role="server")
        workers = sorted(self.workers.items(), key=lambda kv: (kv[1]["worker_id"], kv[1]["local_rank"]))
        for rank, (_, info) in enumerate(workers):
            info.update(rank=rank, node_id=rank, role="worker")
        # Local reduce only if every machine's processes asked for it (they must agree: servers then
        # expect one push per machine instead of one per process).
        local = all(info.get("local_reduce", False) or info["local_size"] == 1 for _, info in workers) and \
            any(info.get("local_reduce", False) for _, info in workers)
        machines = len({info["worker_id"] for _, info in workers})
        self.local_reduce = local
        book = {"epoch": self.epoch, "size": len(workers), "local_reduce": local,
                "timeline": bool(self.timeline.path),  # every node records when the scheduler writes a trace
                "pushers": machines if local else len(workers),
                "servers": [info for _, info in servers], "workers": [info for _, info in workers]}
        # Two phases: workers get the address book only once every server has acknowledged it,
        # so no push can reach a server that does not know the epoch's workers yet.
        for ident, info in servers:
            self._send(ident, Cmd.ADDRBOOK, dict(book, you=info))
        self._pending_book = (book, workers, {ident for ident, _ in servers})
        for ident, _ in servers + workers:
            self.timeline.expect(ident)
        self.running = True
        self.total_workers = len(workers)
        self.left.clear()
        self.idle_since = None
        self.next_index = len(servers)  # indices restart with every epoch's address book

    def _on_server_ready(self, ident, body):
        if self._pending_book is None or body.get("epoch") != self.epoch:
            return
        book, workers, waiting = self._pending_book
        waiting.discard(ident)
        if waiting:
            return
        for w_ident, info in workers:
            self._send(w_ident, Cmd.ADDRBOOK, dict(book, you=info))
        self._pending_book = None
        self.book = book
        logger.info("epoch %d running: %d workers, %d servers", self.epoch, len(workers), len(self.servers))
        self._start_change()  # a server lost meanwhile
        for spare, info in list(self.spares.items()):  # elastic servers that came early
            del self.spares[spare]
            self._admit(spare, info)

    # ---------------------------------------------------------------- running

    def _active_workers(self):
        return [i for i in self.workers if i not in self.left]

    def _on_barrier(self, ident, body):
        name = str(body.get("name", ""))
        group = self.barriers.setdefault(name, set())
        group.add(ident)
        if "value" in body:
            self.barrier_values.setdefault(name, (time.monotonic(), {}))[1][self.workers[ident]["rank"]] = body["value"]
        if group >= set(self._active_workers()):
            release = {"name": name}
            if name in self.barrier_values:
                release["values"] = self.barrier_values.pop(name)[1]
            for member in group:
                self._send(member, Cmd.BARRIER, release)
            del self.barriers[name]

    def _on_declare(self, ident, body):
        """Collect one tensor declaration per worker; answer all of them once everyone has declared."""
        name = body.get("name")
        spec = {"shape": body.get("shape"), "dtype": body.get("dtype"), "kind": body.get("kind")}
        if not isinstance(name, str):
            self._send(ident, Cmd.DECLARE, {"error": "declaration without a tensor name"}, arg=1)
            return
        # Keyed by (name, per-worker declaration count) so a worker's second declaration of the same
        # name (a resized tensor) meets the other workers' second declaration, never their first.
        seq = body.get("seq", 0)
        set_id, members = body.get("set_id", 0), body.get("members")
        if set_id:
            self._on_set_declare(ident, name, seq, spec, set_id, members)
            return
        if spec["kind"] == "broadcast" and self.joined:
            self._send(ident, Cmd.DECLARE, {"name": name, "seq": seq, "error": (
                f"broadcast of {name!r} is not supported while ranks {self._joined_ranks()} have joined (join())")},
                arg=1)
            return
        agreed = (name, (tuple(spec["shape"]), spec["dtype"], spec["kind"]))
        if agreed in self.missed.get(ident, ()):  # declared by the others while this rank was in join()
            self.missed[ident].discard(agreed)
            self._send(ident, Cmd.DECLARE, {"name": name, "seq": seq, "key": self.keys[agreed]})
            return
        pending = self.declares.setdefault((name, seq), {"since": time.monotonic(), "specs": {}})
        pending["specs"][ident] = spec
        self._maybe_declared(name, seq)

    def _on_set_declare(self, ident, name, seq, spec, set_id, members):
        """A tensor of process set ``set_id``: only its members declare it; its key is its own (the same
        name in another set, or in the whole job, is another tensor); servers learn how many members
        push it before any member gets the key."""
        reply = {"name": name, "seq": seq, "set_id": set_id}
        by_rank = {info["rank"]: i for i, info in self.workers.items()}
        if not (isinstance(members, list) and members and all(r in by_rank for r in members)):
            self._send(ident, Cmd.DECLARE, dict(reply, error=f"process set {set_id}: ranks {members} are not all "
                                                             f"ranks of this job (0..{len(by_rank) - 1})"), arg=1)
            return
        pending = self.set_declares.setdefault((name, seq, set_id), {"since": time.monotonic(), "specs": {},
                                                                      "members": {by_rank[r] for r in members}})
        pending["specs"][ident] = dict(spec, members=sorted(members))
        if not set(pending["specs"]) >= pending["members"]:
            return
        del self.set_declares[(name, seq, set_id)]
        specs = pending["specs"]
        distinct = {(tuple(s["shape"]), s["dtype"], s["kind"], tuple(s["members"])) for s in specs.values()}
        if len(distinct) != 1:
            detail = "; ".join(f"rank {self.workers[i]['rank']}: {s['dtype']}{list(s['shape'])} in a {s['kind']} "
                               f"of ranks {s['members']}" for i, s in specs.items())
            msg = f"tensor {name!r} of process set {set_id} differs across its members: {detail}"
            logger.warning(msg)
            for i in specs:
                self._send(i, Cmd.DECLARE, dict(reply, error=msg), arg=1)
            return
        agreed = (name, distinct.pop(), set_id)
        fresh = agreed not in self.keys
        key = self.keys.setdefault(agreed, len(self.keys) + 1)
        replies = [(i, dict(reply, key=key)) for i in specs]
        if not fresh or not self.servers:
            for i, r in replies:
                self._send(i, Cmd.DECLARE, r)
            return
        # two phases, as the address book: no member may push before every server knows the key's pushers
        for server in self.servers:
            self._send(server, Cmd.DECLARE, {"key": key, "pushers": len(specs)})
        self._set_keys_pending[key] = (replies, set(self.servers))

    def _on_server_declared(self, ident, body):
        """A server knows a process set key's pushers: answer its members once every server does."""
        entry = self._set_keys_pending.get(body.get("key"))
        if entry is None:
            return
        replies, waiting = entry
        waiting.discard(ident)
        if not waiting:
            del self._set_keys_pending[body["key"]]
            for i, r in replies:
                self._send(i, Cmd.DECLARE, r)

    def _declarers(self):
        """Workers whose declarations a tensor waits for: every active one not in join()."""
        return set(self._active_workers()) - set(self.joined)

    def _joined_ranks(self):
        return [self.workers[i]["rank"] for i in self.joined]

    def _maybe_declared(self, name, seq):
        pending = self.declares[(name, seq)]
        if set(pending["specs"]) >= self._declarers():
            del self.declares[(name, seq)]
            self._answer_declare(name, seq, pending["specs"])

    def _answer_declare(self, name, seq, specs):
        distinct = {(tuple(s["shape"]), s["dtype"], s["kind"]) for s in specs.values()}
        if len(distinct) == 1:
            spec = distinct.pop()
            key = self.keys.setdefault((name, spec), len(self.keys) + 1)
            for ident in specs:
                self._send(ident, Cmd.DECLARE, {"name": name, "seq": seq, "key": key})
            for ident in self.joined:  # they will use the name after join(): answer them at once then
                self.missed.setdefault(ident, set()).add((name, spec))
            return
        show_kind = len({s["kind"] for s in specs.values()}) > 1
        detail = "; ".join(f"rank {self.workers[i]['rank']}: {s['dtype']}{list(s['shape'])}"
                           + (f" in a {s['kind']}" if show_kind else "")
                           for i, s in sorted(specs.items(), key=lambda kv: self.workers[kv[0]]["rank"]))
        msg = f"tensor {name!r} differs across workers (shape, dtype or operation): {detail}"
        logger.warning(msg)
        for ident in specs:
            self._send(ident, Cmd.DECLARE, {"name": name, "seq": seq, "error": msg}, arg=1)

    def _on_join(self, ident):
        """Horovod's join(): joined ranks contribute zeros to the others' push_pulls until all have joined.

        Every change goes to servers (how many machines still push) and workers (whose copies a
        local reduce no longer waits for). When the last rank joins, everyone is released with
        its rank; that is a sync point at which every key's round count restarts at 0.
        """
        if ident not in self.joined:
            self.joined.append(ident)
        ranks = self._joined_ranks()
        done = set(self.joined) >= set(self._active_workers())
        active = [info for i, info in self.workers.items() if i not in self.joined]
        pushers = len({w["worker_id"] for w in active}) if self.local_reduce else len(active)
        body = {"joined": ranks, "pushers": pushers, "done": done, "last": ranks[-1]}
        if done:
            # two phases, as the address book: workers are released (and push again, from round 0) only
            # once every server has reset its keys, or a push could reach a server still in join()
            for target in self.servers:
                self._send(target, Cmd.JOIN, body)
            self._join_release = (body, set(self.servers))
            self._maybe_release_join()
            self.joined = []
        else:
            for target in [*self.servers, *self.workers]:
                self._send(target, Cmd.JOIN, body)
        for (name, seq), pending in list(self.declares.items()):  # declarations that waited only for this rank
            if self.joined and any(s["kind"] == "broadcast" for s in pending["specs"].values()):
                # a broadcast declared before this rank joined: refuse it as one declared after (the
                # joined rank will never send its part, so answering with a key would hang the others)
                del self.declares[(name, seq)]
                for i in pending["specs"]:
                    self._send(i, Cmd.DECLARE, {"name": name, "seq": seq, "error": (
                        f"broadcast of {name!r} is not supported while ranks {ranks} have joined (join())")},
                        arg=1)
                continue
            self._maybe_declared(name, seq)

    def _maybe_release_join(self, acked=None):
        """Release every worker from join() once every server has acknowledged that all ranks joined."""
        if self._join_release is None:
            return
        body, waiting = self._join_release
        waiting.discard(acked)
        if waiting:
            return
        self._join_release = None
        for target in self.workers:
            self._send(target, Cmd.JOIN, body)

    def _on_leave(self, ident):
        self.left.add(ident)
        # shutdown() is collective: the releases go out when every worker of this epoch has left
        if set(self.workers) <= self.left:
            for w in self.workers:
                self._send(w, Cmd.LEAVE, {"epoch": self.epoch})
            for s in self.servers:
                self._send(s, Cmd.LEAVE, {"epoch": self.epoch})
            logger.info("epoch %d ended: every worker called shutdown()", self.epoch)
            self.epoch += 1
            self.workers = {}
            self.ready = set()
            self.left = set()
            self.barriers.clear()
            self.barrier_values.clear()
            self.declares.clear()
            self.set_declares.clear()
            self.joined, self.missed = [], {}
            self.running = False
            self.idle_since = time.monotonic()
            self.phase_start = self.idle_since

    def _check_stalls(self, now):
        """Fail every pending barrier and declaration once the workers have stood blocked in different
        collectives for STALL_GRACE_S (stalls.py), so that no rank waits out BYTEPS_TIMEOUT for a partner
        that skipped the call."""
        if not (self.running and self.barriers):
            self.stall = None
            return
        rank_of = {i: info.get("rank") for i, info in self.workers.items()}
        msg = stalls.find_deadlock(self._active_workers(), rank_of, self.barriers, self.declares, self.set_declares)
        if msg is None:
            self.stall = None
            return
        sig = stalls.signature(self.barriers, self.declares, self.set_declares)
        if self.stall is None or self.stall[0] != sig:
            self.stall = (sig, now)
            return
        if now - self.stall[1] < min(STALL_GRACE_S, self.cfg.timeout):
            return
        logger.warning("%s", msg)
        self.stall = None
        for name, group in self.barriers.items():
            for ident in group:
                self._send(ident, Cmd.BARRIER, {"name": name, "error": msg})
        self.barriers.clear()
        self.barrier_values.clear()
        for (name, seq), pending in self.declares.items():
            for ident in pending["specs"]:
                self._send(ident, Cmd.DECLARE, {"name": name, "seq": seq, "error": msg}, arg=1)
        self.declares.clear()
        for (name, seq, set_id), pending in self.set_declares.items():
            for ident in pending["specs"]:
                self._send(ident, Cmd.DECLARE, {"name": name, "seq": seq, "set_id": set_id, "error": msg}, arg=1)
        self.set_declares.clear()

    def _on_exit(self, body):
        self.exited.add((body.get("worker_id"), body.get("local_rank")))

    def _job_complete(self):
        return not self.running and self.total_workers is not None and len(self.exited) >= self.total_workers

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
        if self.change is not None and now - self.change["since"] > self.cfg.timeout:
            waiting = self.change.get("waiting") or set()
            who = ", ".join(self._describe(i) for i in sorted(waiting, key=repr)) or "servers joining"
            self._fail(f"server membership {self.change['members']} ({self.change['reason']}) did not complete within "
                       f"{self.cfg.timeout:g} s (BYTEPS_TIMEOUT): no answer from {who}")
        if not self.running and self.idle_since is None and now - self.phase_start > self.cfg.timeout:
            self._fail(f"startup timed out after {self.cfg.timeout:g} s (BYTEPS_TIMEOUT); never registered: "
                       + ", ".join(self._missing()))
        self._check_stalls(now)
        for name, (since, values) in list(self.barrier_values.items()):
            if now - since > self.cfg.timeout:  # the members wait a little longer: they get this error
                lacking = sorted(self.workers[i]["rank"] for i in self._active_workers()
                                 if i not in self.barriers.get(name, ()))
                msg = (f"ranks {lacking} did not send their {name!r} values (link probes) within {self.cfg.timeout:g} s "
                       f"(BYTEPS_TIMEOUT); ranks {sorted(values)} did")
                logger.warning("%s", msg)
                for ident in self.barriers.pop(name, ()):
                    self._send(ident, Cmd.BARRIER, {"name": name, "error": msg})
                del self.barrier_values[name]
        for (name, seq, set_id), pending in list(self.set_declares.items()):
            if now - pending["since"] > self.cfg.timeout:
                have = sorted(self.workers[i]["rank"] for i in pending["specs"])
                lacking = sorted(self.workers[i]["rank"] for i in pending["members"] - set(pending["specs"]))
                msg = (f"tensor {name!r} of process set {set_id} was declared by ranks {have} but not by its members "
                       f"{lacking} within {self.cfg.timeout:g} s (BYTEPS_TIMEOUT)")
                for ident in pending["specs"]:
                    self._send(ident, Cmd.DECLARE, {"name": name, "seq": seq, "set_id": set_id, "error": msg}, arg=1)
                del self.set_declares[(name, seq, set_id)]
        for (name, seq), pending in list(self.declares.items()):
            if now - pending["since"] > self.cfg.timeout:
                have = sorted(self.workers[i]["rank"] for i in pending["specs"])
                lacking = sorted(self.workers[i]["rank"] for i in self._active_workers() if i not in pending["specs"])
                msg = (f"tensor {name!r} was declared by ranks {have} but not by ranks {lacking} within "
                       f"{self.cfg.timeout:g} s (BYTEPS_TIMEOUT): do all workers use the same tensor names?")
                for ident in pending["specs"]:
                    self._send(ident, Cmd.DECLARE, {"name": name, "seq": seq, "error": msg}, arg=1)
                del self.declares[(name, seq)]

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
                for s in self.servers:
                    self._send(s, Cmd.TERMINATE)
                logger.info("job complete: every worker process exited")
                return 0
            if self.idle_since is not None and now - self.idle_since > self.cfg.timeout:
                logger.warning("every worker called shutdown() but not every worker process reported its exit "
                               "within %g s (BYTEPS_TIMEOUT); ending the job", self.cfg.timeout)
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
            logger.warning("dropped a malformed control message: %s", e)
            return
        if header.cmd == Cmd.HELLO:
            if self.gate.secret is None:
                self._send(ident, Cmd.ERROR, {"error": "this scheduler has no BYTEPS_JOB_SECRET but the node uses one"})
            else:
                self._send(ident, Cmd.CHALLENGE, self.gate.challenge(ident, body))
            return
        if header.cmd in (Cmd.REGISTER, Cmd.EXIT) and self.gate.secret is not None \
                and not self.gate.check(ident, body.get("auth")):
            logger.warning("refused %s from pid %s on %s: authentication failed (wrong or missing "
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

    # ---------------------------------------------------------------- elastic servers

    def _can_lose(self, ident):
        """Whether losing server ``ident`` leaves a job that goes on (BYTEPS_ELASTIC=1, not the last server)."""
        if not (self.cfg.elastic and self.running) or self._pending_book is not None:
            return False
        return any(i != ident for i in self.servers)

    def _lose_server(self, ident, reason):
        """Remove a lost server (elastic): the workers re-send what it owed to its replacements."""
        info = self.servers.pop(ident)  # its messages are ignored from now on (not a node of the job)
        self.last_seen.pop(ident, None)
        logger.warning("removing server %d: %s", info["index"], reason)
        self._send(ident, Cmd.TERMINATE, {"reason": f"removed from the job: {reason}"})  # if it is alive after all
        self.changes.append(("lost", info, reason))
        if self.change is not None and ident in self.change.get("admitting", ()):
            self.change["admitting"].discard(ident)  # it died while joining
            self.change["joined"] = [j for j in self.change["joined"] if j["index"] != info["index"]]
            self._maybe_prepare()
        self._start_change()

    def _on_suspect(self, ident, body):
        """A worker's direct link to a server broke: with elastic servers, remove that server now rather than
        after its heartbeat time-out (a SIGKILLed server's links break at once)."""
        index = body.get("server")
        match = [i for i, info in self.servers.items() if info.get("index") == index]
        if not match:
            return  # already removed
        reason = f"{self._describe(ident)} lost its direct link to server {index}"
        if self._can_lose(match[0]):
            self._lose_server(match[0], reason)
        else:
            logger.warning("%s (the job goes on until that server misses its heartbeats)", reason)

    def _admit(self, ident, info):
        """An elastic server joins the running job: it gets the address book, then a membership change."""
        info.update(index=self.next_index, node_id=SERVER_ID_BASE + self.next_index, role="server")
        self.next_index += 1
        self.servers[ident] = info
        self.last_seen[ident] = time.monotonic()
        self.timeline.expect(ident)
        self.changes.append(("joined", info, f"server {info['index']} on {info.get('hostname')} joined"))
        self._start_change()

    def _live_servers(self):
        return sorted(self.servers.values(), key=lambda info: info["index"])

    def _start_change(self):
        """Begin the next membership change (if none runs): joining servers get the address book first."""
        if self.change is not None or not self.changes or not self.running or self._pending_book is not None:
            return
        if not set(self._active_workers()) <= self.ready:  # still starting: they cannot hold yet
            return
        events, self.changes = self.changes, []
        joined = [info for kind, info, _ in events if kind == "joined" and info in self.servers.values()]
        dead = [info for kind, info, _ in events if kind == "lost"]
        self.members += 1
        self.change = {"members": self.members, "since": time.monotonic(), "reason": "; ".join(r for _, _, r in events),
                       "joined": joined, "dead": [info["index"] for info in dead], "waiting": None,
                       "admitting": {i for i, info in self.servers.items() if info in joined}, "counts": {}}
        servers = self._live_servers()
        book = dict(self.book, servers=servers)
        for ident in self.change["admitting"]:
            self._send(ident, Cmd.ADDRBOOK, dict(book, you=self.servers[ident]))
        self._maybe_prepare()

    def _on_admitted(self, ident):
        self.change["admitting"].discard(ident)
        self._maybe_prepare()

    def _maybe_prepare(self):
        """Once every joining server has the address book: PREPARE to every worker."""
        ch = self.change
        if ch is None or ch["admitting"] or ch["waiting"] is not None:
            return
        ch["servers"] = self._live_servers()
        ch["waiting"] = set(self._active_workers())
        for w in ch["waiting"]:
            self._send(w, Cmd.MEMBERS, {"phase": "prepare", "members": ch["members"], "dead": ch["dead"],
                                        "joined": ch["joined"], "reason": ch["reason"]})
        if not ch["waiting"]:
            self._commit()

    def _on_prepared(self, ident, body):
        if body.get("phase") == "ready":
            self.ready.add(ident)
            self._start_change()
            return
        ch = self.change
        if ch is None or body.get("members") != ch["members"] or not ch["waiting"] or ident not in ch["waiting"]:
            return
        ch["waiting"].discard(ident)
        for name, n in (body.get("counts") or {}).items():
            ch["counts"][name] = max(ch["counts"].get(name, 0), int(n))
        if not ch["waiting"]:
            self._commit()

    def _commit(self):
        """Every worker holds: the cut is the largest op count per tensor; the new membership starts there."""
        ch, self.change = self.change, None
        servers = ch["servers"]
        self.book = dict(self.book, servers=servers)
        shares = self._shares(servers)
        for w in self._active_workers():
            self._send(w, Cmd.MEMBERS, {"phase": "commit", "members": ch["members"], "servers": servers,
                                        "cuts": ch["counts"], "reason": ch["reason"]})
        for ident, info in self.servers.items():
            self._send(ident, Cmd.MEMBERS, {"members": ch["members"], "reason": ch["reason"], "shares": shares})
        logger.warning("server membership %d (%s): servers %s, shares %s; the switch took %.3f s",
                       ch["members"], ch["reason"], [s["index"] for s in servers], shares,
                       time.monotonic() - ch["since"])
        self._start_change()

    def _shares(self, servers):
        """Each server's Eq. 1-2 share of the model under the new membership, for the logs."""
        from byteps import placement
        book = dict(self.book, servers=servers)
        weights = placement.weights_for_book(book, placement.server_roles(book))
        return {s["index"]: f"{w}/{sum(weights)}" for s, w in zip(servers, weights)}

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


def write_port_file(path, port):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def main():
    return service.main("scheduler", _Service)


class _Service:
    """The scheduler as ``python -m byteps.scheduler`` runs it: the port file bpslaunch waits for,
    and the job timeline written at the end, also when bpslaunch stops a failed job with SIGTERM."""

    def __init__(self, cfg):
        self.sched = Scheduler(cfg)
        self.grace = min(10.0, cfg.timeout)  # for the nodes' last spans
        port_file = os.environ.get("BYTEPS_SCHEDULER_PORT_FILE")
        if port_file:
            write_port_file(port_file, self.sched.port)
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
