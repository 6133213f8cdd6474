"""The engine's side of the native data plane (core/engine.py): tables, submission, completions, metrics.

A tensor's partitions are registered with the native core once, as a table (wire key, offset,
length, server, staging region, local owner, whether its push is compressed), per membership of
the servers; each op is then one submit() with no per-partition Python. Completions come back on
the thread "byteps-complete" (or to a caller in synchronize()), per op.
"""
import dataclasses

import numpy as np

from byteps import compression
from byteps.errors import BytePSError, BytePSTimeoutError, ProtocolError, TensorMismatchError
from byteps.log import logger

from . import dtypes, stages, table_rows, wire
from . import device_buffer
from .device_buffer import DeviceBuffer
from .ops import Op
from .stages import Stage
from .threads import name_native

from . import _worker_core


Cmd = wire.Cmd

#: the operation kinds of core/stages.py and of tensor declarations (the scheduler compares them)
KINDS = {Cmd.PUSHPULL: "push_pull", Cmd.BROADCAST: "broadcast", Cmd.ASYNC_PUSHPULL: "async push_pull"}


@dataclasses.dataclass(frozen=True)
class _TableSpec:
    """What a native table's partitions depend on (elastic servers rebuild them per membership)."""
    name: str
    tkey: int
    nbytes: int
    dtype: int
    cmd: int
    root: int
    pset: object = None
    codec: object = None  # the wire compressor of its push_pulls (byteps.compression.WireCompressor), or None
    partition_bytes: int = None  # its partitions' size: the job's when its first op was submitted
    nccl: bool = False  # a CUDA push_pull on the NCCL stages (its partitions have roots, not owners)

    @property
    def cut_name(self):
        """How the scheduler names this tensor's op count: the same on every worker (a broadcast's
        root and the others have different tables, and their ops count together)."""
        return f"{self.tkey}:{int(self.cmd)}:{self.nbytes}"


class NativePlane:
    """Native tables, submission and completion of :class:`~byteps.core.engine.Engine` (a mixin)."""

    def _root_self(self, cmd, root):
        """Whether this rank is the root of a broadcast (its table and submission differ)."""
        return cmd == Cmd.BROADCAST and root == self.rank

    def _native_eligible(self, op):
        """Whether ``op`` may run in this job: with BYTEPS_ELASTIC=1 only plain push_pulls and broadcasts,
        which the native core moves to a lost server's replacement (the job's config: every rank agrees)."""
        if not self.cfg.elastic:
            return True
        return op.pset is None and op.cmd != Cmd.ASYNC_PUSHPULL and self._wire_codec(op) is None

    def _native_table(self, op, tkey):
        """(table id, partitions) of ``op``'s tensor in the native core, registered on first use; with
        elastic servers, each later membership's partitions too, from the op number the scheduler cut
        that membership's change at (a tensor first used after a change still counts its ops from 0)."""
        root_self = self._root_self(op.cmd, op.root)
        codec = self._wire_codec(op)
        # the key fixes name, shape and dtype; a table keeps its codec's state, so one per codec setting
        nccl = self.nccl_stages and isinstance(op.buf, DeviceBuffer) and op.cmd == Cmd.PUSHPULL and op.pset is None
        ident = (tkey, op.buf.nbytes, op.cmd, root_self, self._codec_ident(codec), nccl)
        entry = self._native_parts.get(ident)
        if entry is not None:
            return entry
        spec = _TableSpec(op.name, tkey, op.buf.nbytes, op.dtype, op.cmd, op.root, op.pset, codec, op.partition_bytes,
                          nccl)
        with self._native_lock:  # the staging allocator is shared with the engine thread
            first, *later = self._memberships
            rows = self._table_rows(spec, first)
            table = self._native.add_table(op.name, rows, self._codec_settings(codec))
            for m in later:
                rows = self._table_rows(spec, m)
                self._native.add_segment(table, m["cuts"].get(spec.cut_name, 0), rows)
            entry = self._native_parts[ident] = (table, len(rows))
            self._native_specs[table] = spec
        return entry

    @staticmethod
    def _placement_of(membership, spec):
        """A server membership's placement, for partitions of the size the tensor (a _TableSpec) is cut to."""
        placement = membership["placement"]
        if spec.partition_bytes is None or spec.partition_bytes == placement.partition_bytes:
            return placement
        sized = membership.setdefault("resized", {})
        if spec.partition_bytes not in sized:
            sized[spec.partition_bytes] = placement.resized(spec.partition_bytes)
        return sized[spec.partition_bytes]

    def _table_rows(self, op, membership):
        """The native table rows of a tensor (a _TableSpec) under one server membership (see _native_table)."""
        tkey = op.tkey
        local = self.local is not None and op.cmd == Cmd.PUSHPULL and op.pset is None and not op.nccl
        parts = self._placement_of(membership, op).partitions(tkey, op.nbytes, dtypes.itemsize(op.dtype))
        ids, members = membership["ids"], membership["members"]
        rows = table_rows.new(len(parts))
        for row, (i, off, length, at) in enumerate(parts):
            server = ids[at]  # placement numbers the membership's servers 0..S-1; the core, the job's
            key = wire.make_key(tkey, wire.member_partition(i, members))
            table_rows.place(rows, row, key, off, length, server,
                             self._compresses(op.codec, op.dtype, op.nbytes, length, server))
            if op.nccl:  # its root pushes the machine's sum, from its staging slot (a region for a colocated server)
                root = self.local.owner(tkey, i)
                table_rows.nccl_root(rows, row, root)
                if root == self.cfg.local_rank and self.colocated[server] and length:
                    view, desc = self._region(key, length)
                    table_rows.stage(rows, row, view.ctypes.data, desc)
            elif local:  # every partition has a shared region: the owner sums into it, the others copy into it
                view, desc = self._region(key, length)
                table_rows.stage(rows, row, view.ctypes.data, desc)
                table_rows.reduce_locally(rows, row, self.local.owner(tkey, i), self.colocated[server])
            elif self.stages_of(op, server)[0] == Stage.STAGE and length:
                view, desc = self._region(key, length)
                table_rows.stage(rows, row, view.ctypes.data, desc)
        return rows

    def _wire_codec(self, op):
        """The wire compressor that encodes ``op``'s pushes: a plain push_pull's (a process set's ops
        travel raw: docs/compression.md), or None."""
        return op.codec if op.cmd == Cmd.PUSHPULL and op.pset is None else None

    def _codec_ident(self, codec):
        """What a native table's codec state depends on: the codec's settings and size threshold."""
        return None if codec is None else (self._codec_settings(codec), codec.min_bytes)

    def _codec_settings(self, codec):
        """A native table's codec (WorkerCore.add_table): its options and this worker's rank, or None."""
        if codec is None:
            return None
        return (codec.method_id, codec.flags, codec.levels, float(codec.k or 0), codec.seed, codec.momentum,
                codec.nesterov, self.rank)

    def _compresses(self, codec, dtype, tensor_nbytes, length, server):
        """Whether the native core encodes a partition's push: a server on another machine (a colocated
        one reads shared memory) and a codec that applies to its size."""
        return codec is not None and not self.colocated[server] and codec.applies(dtype, tensor_nbytes, length)

    def _native_submit(self, op, tkey, sync=False, lazy=False):
        """Hand ``op`` to the native thread (``sync``: or run it on this thread if it is small and the
        native thread idle). ``lazy``: its completion is left to its caller for a while (prompt()); only
        where the caller submits it itself (an op that waited for its declaration needs a delivery)."""
        op.tkey = tkey
        table, count = self._native_table(op, tkey)
        if not count:  # an empty tensor: nothing to send
            op._finish()
            return
        gpu = isinstance(op.buf, DeviceBuffer)  # copied off the GPU and back per partition, never on this thread
        if gpu and self._gpu_unavailable():
            op.fail(BytePSError(f"push_pull of CUDA tensor {op.name!r}: {self._gpu}"))
            return
        nid = next(self._native_ids)
        self._native_ops[nid] = op  # before submit: the completion thread may deliver it at once
        root_self = self._root_self(op.cmd, op.root)
        op.divided = op.divisor > 1  # the native core divides as it copies each partition's sum in; set before
        # submit, which the completion thread may race to deliver
        if gpu:
            b = op.buf
            self._native.submit_gpu(nid, table, op.cmd, op.dtype, op.root, op.priority, root_self, b.ptr, b.device,
                                    b.nbytes, b.ready_event, b.done_event, lazy=lazy, divisor=op.divisor)
        elif not (sync and count == 1 and self._native.submit_direct(nid, table, op.cmd, op.dtype, op.root,
                                                                   op.priority, root_self, op.buf, op.divisor)):
            self._native.submit(nid, table, op.cmd, op.dtype, op.root, op.priority, root_self, op.buf, lazy=lazy,
                                divisor=op.divisor)
        self.native_submitted += 1
        self.native_averaged += op.divided
        if self.local is not None and op.cmd == Cmd.PUSHPULL and op.pset is None:
            self.native_local_submitted += 1
        # only now: the native side reads an id it does not hold as "finished and forgotten", so a
        # poll() or synchronize() that saw the id before submit() would finish the op with no data
        op.native_id = nid

    def _abandon_rounds(self, name, pset, reason):
        """This rank refused a call of ``name``, a tensor it ran before (any thread): the native core takes
        the rounds the call would have had in the tensor's latest table and pushes the reason in place of
        data (wire.FLAG_ABANDON), so the servers fail those rounds on every rank. False if no table of
        ``name`` (in that process set) exists here."""
        set_id = 0 if pset is None else int(pset[0])
        if pset is not None and self.rank not in pset[1]:
            return True  # the members do not wait for a non-member
        with self._native_lock:
            tables = [t for t, spec in self._native_specs.items() if spec.name == name
                      and (0 if spec.pset is None else spec.pset[0]) == set_id and spec.cmd != Cmd.ASYNC_PUSHPULL]
        if not tables:
            return False
        table = max(tables)  # the tensor's latest use
        spec = self._native_specs[table]
        op = Op(name, np.zeros(spec.nbytes, np.uint8), spec.dtype, (spec.nbytes,), spec.cmd, spec.root, pset=pset)
        nid = next(self._native_ids)
        self._native_ops[nid] = op  # its completion (the servers' error) is delivered and dropped
        root_self = self._root_self(spec.cmd, spec.root)
        self._native.submit_abandon(nid, table, spec.cmd, spec.dtype, spec.root, root_self, op.buf,
                                    f"rank {self.rank} refused the call ({reason})")
        op.native_id = nid
        return True

    def _gpu_unavailable(self):
        """Load the CUDA runtime (and NCCL for the NCCL stages) at the first CUDA tensor, with a staging
        ring of BYTEPS_GPU_STAGING_BYTES in slots of one partition; why it cannot run here, or "" once loaded."""
        with self._native_lock:
            if self._gpu is None:
                path = device_buffer.library_path("cudart", self.cfg.cudart)
                slot = max(self.cfg.partition_bytes, self.placement.partition_bytes)
                try:
                    if path is None:
                        raise RuntimeError("no CUDA runtime library was found (BYTEPS_CUDART names one)")
                    # at least 2 slots: one partition's copy overlaps another's round trip
                    self._native.enable_gpu(path, slot, max(2, self.cfg.gpu_staging_bytes // slot))
                except RuntimeError as e:
                    self._gpu = f"{e} (BYTEPS_CUDART={self.cfg.cudart})" if self.cfg.cudart else str(e)
                    return self._gpu
                try:
                    if self.nccl_stages:  # found at start-up (_nccl_stages)
                        self._native.enable_nccl(device_buffer.library_path("nccl", self.cfg.nccl))
                    self._gpu = ""
                except RuntimeError as e:
                    self._gpu = f"{e} (BYTEPS_NCCL={self.cfg.nccl})" if self.cfg.nccl else str(e)
            return self._gpu

    def _deliver_native(self):
        """Completion thread: sets the events of ops the native thread finished (per op, not per partition)."""
        name_native()
        core = self._native
        while not self._stopped.is_set():
            for nid, kind, text in core.wait(200):
                self._deliver(nid, kind, text)
            for nid in [n for n in self._graveyard if core.forget(n)]:
                del self._graveyard[nid]

    def _deliver(self, nid, kind, text):
        """Finish a native op once, on whichever thread gets there first (completion thread or a caller
        in synchronize()): set its error, its event, run its callbacks, free the native record."""
        op = self._native_ops.pop(nid, None)  # atomic: only one thread gets the op
        if op is None:
            return
        if kind != _worker_core.OK and op.error is None:
            op.error = self._native_error(op, kind, text)
        op._finish()
        if not self._native.forget(nid):  # ZeroMQ still reads the tensor (a failed op): keep it alive
            self._graveyard[nid] = op

    def native_wait(self, op, timeout):
        """Wait up to ``timeout`` s for a native op without the GIL and finish it on this thread."""
        got = self._native.wait_op(op.native_id, int(timeout * 1000))
        if got is not None:
            self._deliver(op.native_id, *got)
        return op.done.is_set()

    def _native_error(self, op, kind, text):
        if kind == _worker_core.ERR_SERVER:
            try:
                msg = wire.decode(text.encode()).get("error", "unknown error")
            except ProtocolError as e:
                msg = str(e)
            return TensorMismatchError(f"push_pull of tensor {op.name!r} failed: {msg}")
        if kind == _worker_core.ERR_TIMEOUT:
            secs, late = text.split("|", 1)
            if late.startswith(("server", "local rank")):  # not "its turn to be sent (...)", nor a server change
                late += (" (a server waits for every machine's push of this tensor and logs the ranks that are "
                         "late; a local rank waits for its machine's other processes)")
            return BytePSTimeoutError(f"push_pull of tensor {op.name!r} waited {secs} s "
                                      f"(BYTEPS_TIMEOUT={self.cfg.timeout:g}) for {late}")
        if kind == _worker_core.ERR_ABORT:
            return self.failure or BytePSError("the byteps engine stopped")
        if kind == _worker_core.ERR_CUDA:
            return BytePSError(f"push_pull of CUDA tensor {op.name!r} failed: {text}")
        return ProtocolError(text)

    def native_done(self, op):
        """True once the native thread has finished ``op`` (any thread; no GIL hand-off needed). The op
        is finished (event, callbacks) by synchronize(), or by the completion thread later."""
        core = self._native
        return core is not None and core.is_done(op.native_id)

    def prompt(self, op):
        """``op`` has a done callback now: have the completion thread deliver it as soon as it is done,
        not wait for a lazy op's caller to finish it (BPS_LAZY_DELIVERY_S, core/pipeline/bps_worker.h)."""
        if op.native_id is not None and self._native is not None:
            self._native.prompt(op.native_id)

    def _drain_native(self):
        """What the native thread hands Python: stray replies, local handshakes, partitions a joined
        process owns, released zero-copy bodies and broken links."""
        for server, frames in self._native.forwarded():
            self._on_stray_reply(server, frames)
        if self._native_local:  # handshakes and link offers of late local peers
            for frames in self._native.forwarded_local():
                self._on_local(None, frames)
            for key, rnd, dtype, nbytes in self._native.owed():  # we are in join()
                self._reduce_owed(key, rnd, dtype, nbytes)
        for server in self._native.lost_links():
            if self.cfg.elastic:  # the scheduler removes it at once, rather than after its heartbeat time-out
                logger.warning("the direct link to server %d broke: reporting it to the scheduler", server)
                self.control.send(Cmd.SUSPECT, {"server": server})

    def transport_bytes(self):
        """Bytes sent to / received from each server on its link."""
        core, servers = self._native, range(len(self.servers))
        return {"sent": {i: n for i in servers if (n := core.bytes_sent(i))},
                "received": {i: n for i in servers if (n := core.bytes_received(i))}}

    def metrics(self):
        """What this worker's data plane did so far, for users, tests and bench/ (byteps.metrics();
        its docstring says what each key means)."""
        native, placement = self._native, self.placement
        traffic = self.transport_bytes()
        # the placement numbers the servers of the current membership by position (docs/elastic.md)
        place = {sid: pos for pos, sid in enumerate(self._memberships[-1]["ids"])}
        hosts = {s["index"]: s["host"] for s in self.book["servers"]}
        servers = [{"index": i, "host": hosts.get(i), "colocated": bool(self.colocated[i]),
                    "role": placement.roles[place[i]] if i in place else "removed",
                    "weight": placement.weights[place[i]] if i in place else 0,
                    "transport": native.link_transport(i) or "none",
                    "bytes_sent": traffic["sent"].get(i, 0), "bytes_received": traffic["received"].get(i, 0)}
                   for i in range(len(self.servers))]
        names = {tkey: name for (name, _), tkey in self._keys.items()}
        partitions = {}  # per tensor name, the partitions of each of its tables, in table order
        for (tkey, *_), (_, count) in sorted(self._native_parts.items(), key=lambda kv: kv[1][0]):
            partitions.setdefault(names.get(tkey, str(tkey)), []).append(count)
        local_reduce = dict(native.local_stats(), ops=self.native_local_submitted) if self._native_local else None
        return {
            "servers": servers,
            # what a tensor first used now is cut to (an optimizer's model may have changed it: expect_model)
            "partition_bytes": self.partition_bytes or placement.partition_bytes,
            "placement_mode": placement.mode,
            "credit_bytes": native.credit,
            "tensors": {name: tkey for (name, _), tkey in self._keys.items()},
            "partitions": partitions,
            "native": {"ops": self.native_submitted, "averaged": self.native_averaged,
                       "direct_calls": native.direct_calls, "links_up": native.links_up,
                       "direct_adopted": native.direct_adopted, "gpu": native.gpu_stats(),
                       "results_sent": native.results_sent, "compressed_pushes": native.compressed_pushes,
                       "replies_in_place": native.replies_in_place, "local_reduce": local_reduce,
                       "stages": {Stage(code).label: n for code, n in native.stage_entries().items() if n}},
            "credit_stalls": native.credit_stalls()[0],
            "local_group": self.local.size if self.local else None,
            "local_strategy": self._local_strategy(),
        }

    def _local_strategy(self):
        if self.local is None:
            return None
        plan = self.local.topology
        return {"owners": "root" if self.local.root_only else "topology" if plan is not None else "owners",
                "plan": None if plan is None else plan.strategy,
                "groups": None if plan is None else [list(g) for g in plan.groups],
                "roots": None if plan is None else list(plan.roots),
                "nccl_stages": self.nccl_stages}

    def stages_of(self, op, server):
        """The ordered stages of a partition of ``op`` that this process pushes itself (core/stages.py);
        the native core plans the local reduce's lists itself (bps_stages.h)."""
        kind = KINDS[op.cmd]
        local = self.local is not None and op.pset is None  # a process set's members push themselves
        ident = (self.colocated[server], kind, local)
        got = self._stage_lists.get(ident)
        if got is None:
            got = self._stage_lists[ident] = stages.stage_list(
                owner=True, local_size=self.cfg.local_size, local_reduce=local,
                colocated=self.colocated[server] and not (op.cmd == Cmd.BROADCAST and op.root != self.rank),
                kind=kind, machines=self.cfg.num_worker)
            logger.info("pipeline of a %s partition (%s server): %s", kind, "colocated" if ident[0] else "remote",
                        stages.describe(got))
        return got

    def _region(self, key, nbytes):
        """This key's shared staging region: (view, descriptor prefix), allocated once."""
        staged = self._staging.get(key)
        if staged is None or staged[0].size != nbytes:
            with self._native_lock:
                staged = self._staging[key] = self._shm.alloc(nbytes)
        return staged

    def _reduce_owed(self, key, rnd, dtype, nbytes):
        """In join(): a local peer sent its copy of a partition this process owns. The native core
        reduces the peers' copies (adding nothing of ours) and pushes the sum, from the partition's
        one-row table given here (encoded as our peers' pushes are: _owed_codec)."""
        if self.rank not in self.joined:  # asked just before our join ended: the copy waits for our next op
            return
        tkey, part = wire.split_key(key)
        server = self.placement.server(tkey, part)
        codec_of, compress, settings = self._owed_codec(tkey, dtype, nbytes, server)
        ident = ("owed", key, nbytes, dtype, codec_of, compress)
        entry = self._native_parts.get(ident)
        if entry is None:
            rows = table_rows.new(1)
            view, desc = self._region(key, nbytes)
            table_rows.place(rows, 0, key, 0, nbytes, server, compress)
            table_rows.stage(rows, 0, view.ctypes.data, desc)
            table_rows.reduce_locally(rows, 0, self.cfg.local_rank, self.colocated[server])
            with self._native_lock:
                table = self._native.add_table(f"join.{tkey}.{part}", rows, settings, codec_of)
                entry = self._native_parts[ident] = (table, 1)
        zeros = self._owed_zeros.get(nbytes)
        if zeros is None:  # stands for our copy only if no peer's is usable; never written
            zeros = self._owed_zeros[nbytes] = np.zeros(nbytes, np.uint8)
        op = Op(f"join.{tkey}.{part}", zeros, dtype, (nbytes // dtypes.itemsize(dtype),))
        op.tkey = tkey
        nid = next(self._native_ids)
        self._native_ops[nid] = op
        self._native.submit_owed(nid, entry[0], rnd, dtype, zeros)
        op.native_id = nid

    def _owed_codec(self, tkey, dtype, nbytes, server):
        """How a joined process pushes a partition of tensor ``tkey`` for its peers: (table whose codec
        and state it shares, or -1; whether it is encoded; the codec's settings when it has its own).
        A tensor this process pushed before it joined continues its latest table's codec state; one it
        never pushed gets the job's BYTEPS_COMPRESSOR, judged as if the tensor were this partition (a
        mismatch with the peers' pushes is then the server's to report)."""
        specs = [(t, s) for t, s in self._native_specs.items()
                 if s.tkey == tkey and s.cmd == Cmd.PUSHPULL and s.pset is None]
        if specs:
            table, spec = max(specs, key=lambda ts: ts[0])  # the latest: the codec of its last push_pulls
            if spec.codec is None:
                return -1, False, None
            return table, self._compresses(spec.codec, dtype, spec.nbytes, nbytes, server), None
        codec = compression.default_codec()
        return -1, self._compresses(codec, dtype, nbytes, nbytes, server), self._codec_settings(codec)

    @staticmethod
    def _on_stray_reply(server, frames):
        """A server's message the native core had no partition for: malformed (logged), or the late
        reply of an op that failed already (dropped)."""
        try:
            wire.unpack(frames[0] if frames else b"")
        except ProtocolError as e:
            logger.warning("malformed reply from server %d: %s", server, e)
