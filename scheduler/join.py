"""Horovod's join(): joined ranks contribute zeros to the others' push_pulls until all have joined."""
from byteps.core import wire

Cmd = wire.Cmd


class Join:
    """The scheduler's join handlers (a part of ``Scheduler``)."""

    def _init_join(self):
        self.joined = []          # worker identities that called join(), in order (Horovod's join)
        self.missed = {}          # joined worker -> {(name, spec)} keyed while it was in join()
        self._join_release = None  # (JOIN body, servers yet to acknowledge) once every rank has joined

    def _joined_ranks(self):
        return [self.workers[i]["rank"] for i in self.joined]

    def _on_join(self, ident):
        """Every change goes to servers (how many machines still push) and workers (whose copies a
        local reduce no longer waits for). When the last rank joins, everyone is released with
        its rank; that is a sync point at which every key's round count restarts at 0."""
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
                self._refuse(pending["specs"], name, seq,
                             f"broadcast of {name!r} is not supported while ranks {ranks} have joined (join())")
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
