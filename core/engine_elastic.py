"""The engine's part in elastic servers (core/engine.py, docs/elastic.md): a new membership's tables and
the links to a server that joins the running job."""
import collections
import time

import zmq

from byteps.errors import BytePSError, BytePSTimeoutError
from byteps.log import logger
from byteps.placement import Placement

from . import auth, shm, wire
from .stages import Stage


Cmd = wire.Cmd


def membership_placement(book, mode, partition_bytes, rank):
    """The placement of a new server membership: the job's partitions, or larger ones where the new shares
    need them (a membership with more servers, or smaller shares, cuts a partition over its servers only
    from a larger size: ``Placement.resized``). Every worker computes the same size from the same book."""
    return Placement.from_book(book, mode, partition_bytes, rank).resized(partition_bytes)


class ElasticServers:
    """Server membership changes of :class:`~byteps.core.engine.Engine` (a mixin)."""

    def _on_members(self, body):
        """The scheduler changes the server set in two steps (docs/elastic.md). PREPARE: hold new ops,
        strand a lost server's partitions, connect to joining servers, and answer with how many ops of
        each tensor were submitted. COMMIT: the n-th op of a tensor uses the new membership's
        partitions from the cut (the largest count over all workers) on; stranded partitions go to
        their replacements in their rounds."""
        if body.get("phase") == "lost":  # while init() runs: stop waiting for that server (engine_setup.py)
            if not self._ready.is_set():
                logger.warning("server %s left the job during start-up (%s): not waiting for it", body.get("server"),
                               body.get("reason"))
                self._lost_at_start.add(body.get("server"))
            return
        if body.get("phase") == "prepare":
            began = time.monotonic()
            counts = self._native.hold(body.get("dead", []))
            for info in body.get("joined", []):
                self._join_server(info)
            by_name = collections.Counter()
            for table, n in enumerate(counts):
                spec = self._native_specs.get(table)
                if spec is not None:
                    by_name[spec.cut_name] += n
            self._change = (body, began)
            self.control.send(Cmd.MEMBERS, {"phase": "prepared", "members": body["members"], "counts": by_name})
            return
        if body.get("phase") != "commit":
            logger.warning("unexpected MEMBERS phase %r", body.get("phase"))
            return
        prepared, began = self._change or (body, time.monotonic())
        self._change = None
        servers = body["servers"]
        self.book = dict(self.book, servers=servers)
        self.placement = membership_placement(self.book, self.cfg.placement, self.cfg.partition_bytes, self.rank)
        m = {"members": body["members"], "placement": self.placement, "cuts": body.get("cuts", {}),
             "ids": [info["index"] for info in servers]}
        self._memberships.append(m)
        segments = []
        with self._native_lock:
            for ident, (table, _) in list(self._native_parts.items()):
                spec = self._native_specs[table]
                rows = self._table_rows(spec, m)
                segments.append((table, m["cuts"].get(spec.cut_name, 0), rows))
                self._native_parts[ident] = (table, len(rows))
            self._native.commit(m["ids"], segments)
        logger.warning("servers changed (membership %d, %s): servers %s; %s; partitions of %d bytes; this worker "
                       "switched in %.3f s", m["members"], prepared.get("reason", "?"), m["ids"],
                       self.placement.describe(), self.placement.partition_bytes, time.monotonic() - began)

    def _join_server(self, info):
        """Connect to a server that joins the running job: authenticate, open its direct link, and hand
        both to the native thread as server ``info["index"]``."""
        index = info["index"]
        if index != len(self.servers):
            raise BytePSError(f"the scheduler admitted server {index}, but this worker knows {len(self.servers)} "
                              "servers: a membership change was missed")
        sock = self._dealer(f"tcp://{info['host']}:{info['port']}")
        ident = sock.getsockopt(zmq.IDENTITY)
        limit, who = min(self.cfg.timeout, 10.0), f"server {index} ({info['host']}:{info['port']})"
        secret = auth.job_secret()
        if secret is not None:
            knock = auth.Knock(secret, ident)
            header, body = self._ask(sock, wire.control(Cmd.HELLO, self.control.node_id, knock.hello()), limit, who)
            self._answer_challenge(sock, knock, header, body, who)
        header, answer = self._ask(sock, wire.control(Cmd.LINK, self.control.node_id), limit, who)
        if header.cmd != Cmd.LINK or "port" not in answer:
            raise BytePSError(f"{who} answered LINK with {Cmd(header.cmd).name} {answer}: no direct link to it")
        fd = self._open_server_link(who, info["host"], answer, ident)
        shared = (self.cfg.enable_ipc and Stage.STAGE not in self._dropped and info["host"] == self.cfg.node_host
                  and shm.can_share(info.get("shm"), self._maps))
        if shared and self._shm is None:
            self._shm = shm.Allocator("byteps-worker")
        self.colocated.append(shared)
        self._native.set_colocated(index, shared)
        self.servers.append(sock)
        self._native.add_server_live(fd)
        logger.info("%s joined: direct TCP link", who)

    def _ask(self, sock, frames, limit, who):
        """Send ``frames`` on ``sock`` and wait up to ``limit`` s for its answer: (header, body)."""
        sock.send_multipart(frames)
        if not sock.poll(limit * 1000):
            raise BytePSTimeoutError(f"{who} did not answer {Cmd(wire.unpack(frames[0]).cmd).name} within {limit:g} s")
        got = sock.recv_multipart()
        return wire.unpack(got[0]), (wire.decode(got[1]) if len(got) > 1 else {})
