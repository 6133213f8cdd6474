"""Elastic servers (BYTEPS_ELASTIC=1, docs/elastic.md): servers leave and join a running job.

A lost server that is not the last one (silent, or a worker's direct link to it broke: SUSPECT) is
removed instead of failing the job, and a server that registers while the job runs is admitted.
Each change is a new server membership, made in two steps: PREPARE tells every worker the new
servers (workers hold new ops and answer how many ops of each tensor they had submitted); COMMIT
hands them the cut, the largest count per tensor, from which every worker's ops use the new
membership. One change at a time; events that arrive meanwhile make the next one.
"""
import time

from byteps.core import wire
from byteps.log import logger

from .registration import SERVER_ID_BASE

Cmd = wire.Cmd


class ElasticServers:
    """The scheduler's server membership changes (a part of ``Scheduler``)."""

    def _init_elastic(self):
        self.members = 0          # server membership number, bumped by every change
        self.next_index = 0       # index of the next server admitted (indices are never reused)
        self.spares = {}          # identity -> info of elastic servers that registered before the job started
        self.changes = []         # queued events: ("lost" or "joined", the server's info, reason)
        self.change = None        # the change in progress: see _start_change
        self.ready = set()        # workers whose engine can take a change (MEMBERS "ready", after start-up)

    def _can_lose(self, ident):
        """Whether losing server ``ident`` leaves a job that goes on (BYTEPS_ELASTIC=1, not the last
        server): at every moment, from its registration on."""
        if not self.cfg.elastic:
            return False
        if not self.running:  # registration: the job starts with the servers that remain
            return self._servers_needed() > 1
        return any(i != ident for i in self.servers)

    def _lose_server(self, ident, reason):
        """Remove a lost server (elastic): the workers re-send what it owed to its replacements."""
        info = self.servers.pop(ident)  # its messages are ignored from now on (not a node of the job)
        self.last_seen.pop(ident, None)
        self.servers_lost += 1
        self._send(ident, Cmd.TERMINATE, {"reason": f"removed from the job: {reason}"})  # if it is alive after all
        if not self.running:  # it has no index yet: the epoch starts without it
            logger.warning("removing server (pid %s on %s) before the job started: %s; the job starts with %d "
                           "servers", info.get("pid"), info.get("hostname"), reason, self._servers_needed())
            self._maybe_start()
            return
        logger.warning("removing server %d: %s", info["index"], reason)
        self.changes.append(("lost", info, reason))
        if self._pending_book is not None:  # it will not acknowledge the address book: the workers get it now
            self._pending_book[2].discard(ident)
            self._maybe_send_book()
            return
        if self.change is not None and ident in self.change.get("admitting", ()):
            self.change["admitting"].discard(ident)  # it died while joining
            self.change["joined"] = [j for j in self.change["joined"] if j["index"] != info["index"]]
            self._maybe_prepare()
        self._tell_starting_workers(info, reason)
        self._start_change()

    def _tell_starting_workers(self, info, reason):
        """Workers still in init() (authenticating, probing, opening links) stop waiting for a lost
        server at once; the membership change that removes it follows once they are all ready."""
        for w in self._active_workers():
            if w not in self.ready:
                self._send(w, Cmd.MEMBERS, {"phase": "lost", "server": info["index"], "reason": reason})

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
        from byteps import placement
        ch, self.change = self.change, None
        servers = ch["servers"]
        self.book = dict(self.book, servers=servers)
        # each server's Eq. 1-2 share of the model under the new membership, for the logs
        weights = placement.weights_for_book(self.book, placement.server_roles(self.book))
        shares = {s["index"]: f"{w}/{sum(weights)}" for s, w in zip(servers, weights)}
        for w in self._active_workers():
            self._send(w, Cmd.MEMBERS, {"phase": "commit", "members": ch["members"], "servers": servers,
                                        "cuts": ch["counts"], "reason": ch["reason"]})
        for ident, info in self.servers.items():
            self._send(ident, Cmd.MEMBERS, {"members": ch["members"], "reason": ch["reason"], "shares": shares})
        logger.warning("server membership %d (%s): servers %s, shares %s; the switch took %.3f s",
                       ch["members"], ch["reason"], [s["index"] for s in servers], shares,
                       time.monotonic() - ch["since"])
        self._start_change()

    def _check_change(self, now):
        if self.change is not None and now - self.change["since"] > self.cfg.timeout:
            waiting = self.change.get("waiting") or set()
            who = ", ".join(self._describe(i) for i in sorted(waiting, key=repr)) or "servers joining"
            self._fail(f"server membership {self.change['members']} ({self.change['reason']}) did not complete within "
                       f"{self.cfg.timeout:g} s (BYTEPS_TIMEOUT): no answer from {who}")
