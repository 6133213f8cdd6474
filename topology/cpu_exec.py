"""The CPU analogue: run a plan's local aggregation among a machine's worker processes.

On a machine without GPUs the same :class:`~byteps.topology.strategy.Plan` that would drive NCCL
drives local processes through shared memory, with the plan's groups standing in for PCIe switch
groups (NUMA nodes by default). Every step of the GPU pipeline has a counterpart here, so the
strategy logic and the slicing shared with core/gpu_stages.py run and are tested everywhere:

==================  ===============================  =========================================
GPU stage           this module                      where the bytes go
==================  ===============================  =========================================
(tensor on GPU)     STAGE                            tensor -> own shared region S
REDUCE-SCATTER      group slice sum                  members' S[slice] -> group buffer H (the
 + COPYD2H                                           group leader's arena, = the pinned host copy)
PCIE_REDUCE         range sum across groups          groups' H[range] -> result R (rank 0's arena)
(network)           ``network`` hook, per range      R[range] (the owner would push/pull here)
COPYH2D             copy back the group slice        R[slice] -> own S[slice]
ALL-GATHER          gather the group's slices        members' S[slice] -> tensor
REDUCE / BROADCAST  per partition, at its root       all S[part] -> root's H[part] -> tensors
==================  ===============================  =========================================

``reduce_scatter`` is ``cpu_assisted`` with one group (no PCIE_REDUCE); ``none`` only calls the
hook. Sums use the Cython kernels (``sum_many``, nogil, fp16/bf16 accumulated in fp32); copies
use ``copy_into``; no Python runs per element. Barriers (topology/localsync.py) separate the
steps, carry the tensor's byte count and dtype (a mismatch fails on every rank with both values),
and time out naming the ranks that never arrived.
"""
import numpy as np

from byteps.core import dtypes
from byteps.core._reduce import copy_into, sum_many
from byteps.core.shm import PAGE

from .localsync import LocalGroup

# barrier phases of one operation
_STAGED, _GROUP_SUMMED, _MACHINE_SUMMED, _COPIED_BACK, _DONE = range(1, 6)


def _pad(nbytes):
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


class CpuExecutor:
    """One local process's side of a plan's aggregation.

    Args:
        plan: the machine's Plan (every local process must use the same one).
        local_rank: this process's local rank.
        token: shared by the machine's processes, unique to the job (see LocalGroup).
        capacity: the largest tensor, in bytes, this executor will aggregate.
        timeout: seconds each wait may last.
        partition_bytes: partition size for reduce_broadcast (partitions round-robin over roots).
    """

    def __init__(self, plan, local_rank, token, capacity, timeout=30.0, partition_bytes=4096000):
        self.plan = plan
        self.rank = local_rank
        self.cap = _pad(capacity)
        self.partition_bytes = partition_bytes
        # this process's arena: S (staged tensor) | H (group / root host buffer) | R (machine sum)
        self.group = LocalGroup(token, local_rank, plan.local_size, 3 * self.cap, timeout)
        self.seq = 0

    def _region(self, rank, which, nbytes):
        base = {"S": 0, "H": 1, "R": 2}[which] * self.cap
        return self.group.peers[rank][base:base + nbytes]

    def push_pull(self, tensor, network=None, dtype=None):
        """Sum ``tensor`` (C-contiguous numpy array) over the machine's processes, in place.

        ``network(view, start, stop, nic)``, if given, is called by the process that owns each
        piece of the machine's sum (element range [start, stop)) before it is broadcast back; it
        may change the view in place (an engine would push it and pull the global sum into it).
        ``dtype``: a byteps.core.dtypes code, for bfloat16 held as uint16 (default: from the array).
        Returns ``tensor``.
        """
        arr = np.ascontiguousarray(tensor)
        if arr is not tensor and not np.shares_memory(arr, tensor):
            raise ValueError("push_pull needs a C-contiguous array (it works in place)")
        code = dtypes.from_name(arr.dtype.name) if dtype is None else dtype
        nbytes = arr.nbytes
        if nbytes > self.cap:
            raise ValueError(f"tensor of {nbytes} bytes exceeds this executor's capacity of {self.cap} bytes")
        self.seq += 1
        flat = arr.reshape(-1).view(np.uint8)
        isz = dtypes.itemsize(code)
        count = nbytes // isz
        sig = (nbytes, code)
        strategy = self.plan.strategy
        if strategy == "none" or self.plan.local_size == 1:
            if network is not None:
                network(arr.reshape(-1), 0, count, self.plan.rails[self.rank] if self.plan.rails else "")
            return tensor
        if strategy == "reduce_broadcast":
            self._reduce_broadcast(flat, count, isz, code, sig, network)
        else:
            self._groups(flat, count, isz, code, sig, network)
        return tensor

    # -- reduce-scatter within groups, sum across groups, all-gather -------------------------
    def _groups(self, flat, count, isz, code, sig, network):
        plan, me, seq = self.plan, self.rank, self.seq
        everyone = range(plan.local_size)
        gi, pos = plan.group_of(me)
        members = plan.groups[gi]
        nbytes = count * isz
        copy_into(self._region(me, "S", nbytes), flat)                               # STAGE
        self.group.barrier(seq, _STAGED, members, sig, "stage")
        s, e = plan.group_slices(me, count)
        leader = members[0]
        if e > s:                                                                    # REDUCE-SCATTER + D2H
            sum_many(self._region(leader, "H", nbytes)[s * isz:e * isz],
                     [self._region(r, "S", nbytes)[s * isz:e * isz] for r in members], code)
        leaders = [g[0] for g in plan.groups]
        a, b = plan.reduce_ranges(count)[me]
        if len(plan.groups) > 1:
            self.group.barrier(seq, _GROUP_SUMMED, everyone, sig, "group sums")
            result = "R", 0
            if b > a:                                                                # PCIE_REDUCE
                sum_many(self._region(0, "R", nbytes)[a * isz:b * isz],
                         [self._region(ld, "H", nbytes)[a * isz:b * isz] for ld in leaders], code)
        else:
            result = "H", leader  # one group: its host copy is the machine's sum (range r == slice r)
        out = self._region(result[1], result[0], nbytes)
        if network is not None and b > a:
            network(out[a * isz:b * isz].view(_numpy_dtype(code)), a, b, plan.rails[me])
        if len(plan.groups) > 1:
            self.group.barrier(seq, _MACHINE_SUMMED, everyone, sig, "machine sum")
        if e > s:                                                                    # COPYH2D
            copy_into(self._region(me, "S", nbytes)[s * isz:e * isz], out[s * isz:e * isz])
        self.group.barrier(seq, _COPIED_BACK, members, sig, "copy back")
        for k, r in enumerate(members):                                              # ALL-GATHER
            ks, ke = plan.group_slices(r, count)
            if ke > ks:
                copy_into(flat[ks * isz:ke * isz], self._region(r, "S", nbytes)[ks * isz:ke * isz])
        self.group.barrier(seq, _DONE, everyone, sig, "gather")  # regions free for the next operation

    # -- reduce to roots, broadcast from them -------------------------------------------------
    def _reduce_broadcast(self, flat, count, isz, code, sig, network):
        from .strategy import partition_bounds

        plan, me, seq = self.plan, self.rank, self.seq
        everyone = range(plan.local_size)
        nbytes = count * isz
        copy_into(self._region(me, "S", nbytes), flat)
        self.group.barrier(seq, _STAGED, everyone, sig, "stage")
        parts = partition_bounds(count, isz, self.partition_bytes)
        for i, (a, b) in enumerate(parts):
            if plan.root_for(i) != me or b <= a:
                continue
            dst = self._region(me, "H", nbytes)[a * isz:b * isz]                     # REDUCE + D2H at the root
            sum_many(dst, [self._region(r, "S", nbytes)[a * isz:b * isz] for r in everyone], code)
            if network is not None:
                network(dst.view(_numpy_dtype(code)), a, b, plan.rails[me])
        self.group.barrier(seq, _MACHINE_SUMMED, everyone, sig, "reduce")
        for i, (a, b) in enumerate(parts):                                           # BROADCAST
            if b > a:
                copy_into(flat[a * isz:b * isz], self._region(plan.root_for(i), "H", nbytes)[a * isz:b * isz])
        self.group.barrier(seq, _DONE, everyone, sig, "broadcast")

    def close(self):
        self.group.close()


def _numpy_dtype(code):
    return dtypes.numpy_view_dtype(code)
