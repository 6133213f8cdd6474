"""Barriers and tensor declarations, and the waits among them that cannot end.

Every worker declares each tensor name with its shape and dtype; when all have, the specs are
compared and one key is handed out, or a mismatch error naming the ranks goes to all of them. A
process set's tensor is declared by its members only and has a key of its own.
"""
import time

from byteps.core import wire
from byteps.log import logger

from . import stalls

Cmd = wire.Cmd
STALL_GRACE_S = 3.0  # how long workers stand blocked in different collectives before they are failed


class Declarations:
    """The scheduler's barrier and declaration handlers (a part of ``Scheduler``)."""

    def _init_declarations(self):
        self.barriers = {}        # name -> set of identities
        # name -> (since, {rank: value}) of barriers whose members send a value (byteps/autotune.py's
        # partition-size agreement): the release hands every member all of them
        self.barrier_values = {}
        self.stall = None         # (signature, since) of waits that cannot end (stalls.py), while they stand
        self.declares = {}        # (name, spec json) ... see _on_declare
        self.set_declares = {}    # (name, seq, set id) -> declarations of a process set's tensor (_on_set_declare)
        self.keys = {}            # (name, spec) -> tensor key, stable for the whole job
        self._set_keys_pending = {}  # process set key -> (its members' replies, servers yet to learn it)

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
        if "abandoned" in body:  # the rank refused the call before declaring it (core/engine.py _abandon)
            spec = {"abandoned": str(body["abandoned"])}
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
        if "abandoned" not in spec:
            if spec["kind"] == "broadcast" and self.joined:
                self._refuse([ident], name, seq, f"broadcast of {name!r} is not supported while ranks "
                                                  f"{self._joined_ranks()} have joined (join())")
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
            self._refuse([ident], name, seq, f"process set {set_id}: ranks {members} are not all ranks of this job "
                                              f"(0..{len(by_rank) - 1})", set_id)
            return
        pending = self.set_declares.setdefault((name, seq, set_id), {"since": time.monotonic(), "specs": {},
                                                                      "members": {by_rank[r] for r in members}})
        pending["specs"][ident] = dict(spec, members=sorted(members))
        if not set(pending["specs"]) >= pending["members"]:
            return
        del self.set_declares[(name, seq, set_id)]
        specs = pending["specs"]
        if self._refuse_abandoned(specs, name, seq, set_id):
            return
        distinct = {(tuple(s["shape"]), s["dtype"], s["kind"], tuple(s["members"])) for s in specs.values()}
        if len(distinct) != 1:
            detail = "; ".join(f"rank {self.workers[i]['rank']}: {s['dtype']}{list(s['shape'])} in a {s['kind']} "
                               f"of ranks {s['members']}" for i, s in specs.items())
            msg = f"tensor {name!r} of process set {set_id} differs across its members: {detail}"
            logger.warning(msg)
            self._refuse(specs, name, seq, msg, set_id)
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

    def _maybe_declared(self, name, seq):
        pending = self.declares[(name, seq)]
        if set(pending["specs"]) >= set(self._active_workers()) - set(self.joined):  # all but ranks in join()
            del self.declares[(name, seq)]
            self._answer_declare(name, seq, pending["specs"])

    def _refuse_abandoned(self, specs, name, seq, set_id=None):
        """If a rank abandoned the call (refused it before declaring), fail it on every rank, naming who
        and why; True if so."""
        abandoned = sorted((self.workers[i]["rank"], s["abandoned"]) for i, s in specs.items() if "abandoned" in s)
        if not abandoned:
            return False
        msg = f"tensor {name!r}: " + "; ".join(f"rank {r} refused the call ({why})" for r, why in abandoned)
        logger.warning(msg)
        self._refuse(specs, name, seq, msg, set_id)
        return True

    def _answer_declare(self, name, seq, specs):
        if self._refuse_abandoned(specs, name, seq):
            return
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
        self._refuse(specs, name, seq, msg)

    def _refuse(self, idents, name, seq, error, set_id=None):
        """Answer the declarations of ``idents`` with ``error`` (a process set's: with its ``set_id``)."""
        body = {"name": name, "seq": seq} if set_id is None else {"name": name, "seq": seq, "set_id": set_id}
        for ident in idents:
            self._send(ident, Cmd.DECLARE, dict(body, error=error), arg=1)

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
            self._refuse(pending["specs"], name, seq, msg)
        self.declares.clear()
        for (name, seq, set_id), pending in self.set_declares.items():
            self._refuse(pending["specs"], name, seq, msg, set_id)
        self.set_declares.clear()

    def _expire_waits(self, now):
        """Fail the barriers and declarations that stood longer than BYTEPS_TIMEOUT, naming who is missing."""
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
                self._refuse(pending["specs"], name, seq, msg, set_id)
                del self.set_declares[(name, seq, set_id)]
        for (name, seq), pending in list(self.declares.items()):
            if now - pending["since"] > self.cfg.timeout and stalls.abandoned_only(pending):
                del self.declares[(name, seq)]  # no rank declared it but those that refused it: nobody waits
            elif now - pending["since"] > self.cfg.timeout:
                have = sorted(self.workers[i]["rank"] for i in pending["specs"])
                lacking = sorted(self.workers[i]["rank"] for i in self._active_workers() if i not in pending["specs"])
                gone = sorted(self.workers[i]["rank"] for i in self.left if i in self.workers and
                              i not in pending["specs"])
                msg = (f"tensor {name!r} was declared by ranks {have} but not by ranks {sorted(lacking + gone)}"
                       + (f" ({', '.join(map(str, gone))} left the job without declaring it)" if gone else "")
                       + f" within {self.cfg.timeout:g} s (BYTEPS_TIMEOUT): do all workers use the same tensor names?")
                self._refuse(pending["specs"], name, seq, msg)
                del self.declares[(name, seq)]
