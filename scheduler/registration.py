"""Registration and the epochs: who is in the job, when it starts, when an epoch ends.

Servers and worker processes send REGISTER. When DMLC_NUM_SERVER servers and, for every
DMLC_WORKER_ID, all of its BYTEPS_LOCAL_SIZE processes are in, ranks are assigned (workers sorted by
(worker id, local rank); servers by (host, port)) and every node gets the address book: servers
first, workers once every server has acknowledged it, so no push can reach a server before it knows
the epoch's workers. An epoch ends when every worker has called shutdown() (LEAVE); the job when
every worker process has sent EXIT.
"""
import time

from byteps.core import wire
from byteps.log import logger

Cmd = wire.Cmd
SERVER_ID_BASE = 1 << 20  # server i has node id SERVER_ID_BASE + i; worker node id == rank


class Registration:
    """The scheduler's registration and epoch handlers (a part of ``Scheduler``)."""

    def _init_registration(self):
        self.exited = set()       # (worker_id, local_rank) of worker processes that exited
        self.phase_start = time.monotonic()
        self.idle_since = None    # when every worker had left; bounded by BYTEPS_TIMEOUT
        self.total_workers = None  # worker processes in the job, known once the first epoch starts
        self._pending_book = None  # (book, workers, servers yet to acknowledge) while an epoch starts
        self.servers_lost = 0     # servers removed from the job (elastic): later epochs start without them
        self._workers_in_at = None  # when every worker of the starting epoch had registered (elastic)

    def _servers_needed(self):
        """Servers an epoch waits for: DMLC_NUM_SERVER, less those the job has lost (elastic)."""
        return max(1, self.cfg.num_server - self.servers_lost)

    def _missing(self):
        """Names of the nodes that have not registered yet, for the startup-timeout message."""
        missing = []
        needed = self._servers_needed()
        if len(self.servers) < needed:
            missing.append(f"{needed - len(self.servers)} of {needed} servers")
        return missing + self._missing_workers()

    def _missing_workers(self):
        missing = []
        have = {(i["worker_id"], i["local_rank"]) for i in self.workers.values()}
        sizes = {info["worker_id"]: info["local_size"] for info in self.workers.values()}
        for wid in range(self.cfg.num_worker):
            if wid not in sizes:
                missing.append(f"worker DMLC_WORKER_ID={wid} (no process registered)")
                continue
            lost = [r for r in range(sizes[wid]) if (wid, r) not in have]
            if lost:
                missing.append(f"worker DMLC_WORKER_ID={wid} local ranks {lost}")
        return missing

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
            if self.epoch == 0 and not self.running and len(self.servers) < self._servers_needed():
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
            elif body.get("elastic"):  # bpslaunch --join, or BYTEPS_ELASTIC=1 on this server only
                self._send(ident, Cmd.ERROR, {"error": "this job admits no server once its DMLC_NUM_SERVER="
                                                       f"{self.cfg.num_server} have registered: its scheduler does "
                                                       "not have BYTEPS_ELASTIC=1 (docs/elastic.md)"})
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
        if self.running or len(self.servers) < self._servers_needed() or self._missing():
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
        self._pending_book[2].discard(ident)
        self._maybe_send_book()

    def _maybe_send_book(self):
        """Once every server of the pending address book has acknowledged it (or was lost meanwhile,
        elastic): the book to every worker, with the losses it already holds."""
        book, workers, waiting = self._pending_book
        if waiting:
            return
        for w_ident, info in workers:
            self._send(w_ident, Cmd.ADDRBOOK, dict(book, you=info))
        self._pending_book = None
        self.book = book
        logger.info("epoch %d running: %d workers, %d servers", self.epoch, len(workers), len(self.servers))
        for kind, info, reason in self.changes:  # servers lost before the workers had the book
            if kind == "lost":
                self._tell_starting_workers(info, reason)
        self._start_change()
        for spare, info in list(self.spares.items()):  # elastic servers that came early
            del self.spares[spare]
            self._admit(spare, info)

    def _on_leave(self, ident):
        self.left.add(ident)
        # shutdown() is collective: the releases go out when every worker of this epoch has left
        if set(self.workers) <= self.left:
            for ident in [*self.workers, *self.servers]:
                self._send(ident, Cmd.LEAVE, {"epoch": self.epoch})
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

    def _on_exit(self, body):
        self.exited.add((body.get("worker_id"), body.get("local_rank")))

    def _job_complete(self):
        return not self.running and self.total_workers is not None and len(self.exited) >= self.total_workers

    def _check_startup(self, now):
        if self.running:
            return
        if self.cfg.elastic and self.servers and not self._missing_workers():
            # Every worker is in. A server still absent BYTEPS_HEARTBEAT_TIMEOUT later is lost (killed before
            # it could register, as a registered one is after that silence): start without it; if it comes
            # after all, it joins the running job.
            if self._workers_in_at is None:
                self._workers_in_at = now
            elif now - self._workers_in_at > self.cfg.heartbeat_timeout and len(self.servers) < self._servers_needed():
                absent = self._servers_needed() - len(self.servers)
                self.servers_lost += absent
                logger.warning("%d server(s) did not register within %g s (BYTEPS_HEARTBEAT_TIMEOUT) of the last "
                               "worker: the job starts with %d servers (a late one joins it)", absent,
                               self.cfg.heartbeat_timeout, len(self.servers))
                self._maybe_start()
                return
        else:
            self._workers_in_at = None
        if self.idle_since is None and now - self.phase_start > self.cfg.timeout:
            self._fail(f"startup timed out after {self.cfg.timeout:g} s (BYTEPS_TIMEOUT); never registered: "
                       + ", ".join(self._missing()))
