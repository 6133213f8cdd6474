"""The CPU analogue: run a plan's local aggregation among a machine's worker processes.

On a machine without GPUs the same :class:`~byteps.topology.strategy.Plan` that would drive NCCL
drives local processes through shared memory, with the plan's groups standing in for PCIe switch
groups (NUMA nodes by default). Every step of the GPU pipeline has a counterpart here, so the
strategy logic and the slicing shared with core/gpu_stages.py run and are tested everywhere:

==================  ===============================  =========================================
GPU stage           this module                      where the bytes go
==================  ===============================  =========================================
(tensor on GPU)     STAGE                            tensor -> own shared region S (but the
                                                     own group slice, read from the tensor)
REDUCE-SCATTER      group slice sum                  members' S[slice] -> group buffer H (the
 + COPYD2H                                           group leader's arena, = the pinned host copy)
PCIE_REDUCE         range sum across groups          groups' H[range] -> result R (rank 0's arena)
(network)           ``network`` hook, per range      R[range] (the owner would push/pull here)
COPYH2D +           copy the machine's sum back      R -> tensor (on GPUs: the slice back, then an
ALL-GATHER                                           all-gather inside the switch; on the CPU it
                                                     is one memory, so one copy instead of two)
REDUCE / BROADCAST  per partition, at its root       all S[part] -> root's H[part] -> tensors
==================  ===============================  =========================================

``reduce_scatter`` is ``cpu_assisted`` with one group (no PCIE_REDUCE); ``none`` only calls the
hook. Sums use the Cython kernels (``sum_many``, nogil, fp16/bf16 accumulated in fp32); copies
use ``copy_into``; no Python runs per element. Barriers (topology/localsync.py) separate the
steps, carry the tensor's byte count and dtype (a mismatch fails on every rank with both values:
the first barrier of an operation includes every local process), and time out naming the ranks
that never arrived.

The ``network`` hook (core/local_exec.py pushes and pulls the range there) may return a callable:
the executor calls every hook of this process first and then those callables, so a process that
owns several ranges (reduce_broadcast) has them all on the network at once. An exception from the
hook or its callable does not leave the other processes waiting: it is reported in the next
barrier of every local process, which then all raise (LocalPeerError) in step, and the raising
process raises its own exception.
"""
import collections

import numpy as np

from byteps.core import dtypes
from byteps.core._reduce import copy_into, sum_many
from byteps.core.shm import PAGE

from .localsync import LocalGroup, LocalPeerError

# barrier phases of one operation; an operation's first barrier (everyone, _STAGED) also ends the
# previous one: before it a process writes only its own S, which nobody reads after _MACHINE_SUMMED
_STAGED, _GROUP_SUMMED, _MACHINE_SUMMED = range(1, 4)


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
        #: steps this process ran (tests check which stages a plan really used): "stage",
        #: "group_reduce", "pcie_reduce", "network", "root_reduce", "gather"
        self.stats = collections.Counter()

    def _region(self, rank, which, nbytes):
        base = {"S": 0, "H": 1, "R": 2}[which] * self.cap
        return self.group.peers[rank][base:base + nbytes]

    def push_pull(self, tensor, network=None, dtype=None, tag=0):
        """Sum ``tensor`` (C-contiguous numpy array) over the machine's processes, in place.

        ``network(view, start, stop, nic)``, if given, is called by the process that owns each
        piece of the machine's sum (element range [start, stop)) before it is broadcast back; it
        may change the view in place (an engine would push it and pull the global sum into it),
        and may return a callable that finishes that work (see the module docstring).
        ``dtype``: a byteps.core.dtypes code, for bfloat16 held as uint16 (default: from the array).
        ``tag``: an integer every process must pass the same (e.g. the tensor key), checked in the
        barriers like the byte count and dtype. Returns ``tensor``.
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
        sig = (nbytes, code, tag)
        strategy = self.plan.strategy
        if strategy == "none" or self.plan.local_size == 1:
            if network is not None:
                self.stats["network"] += 1
                _finish([network(arr.reshape(-1), 0, count, self.plan.rails[self.rank] if self.plan.rails else "")])
            return tensor
        if strategy == "reduce_broadcast":
            self._reduce_broadcast(flat, count, isz, code, sig, network)
        else:
            self._groups(flat, count, isz, code, sig, network)
        return tensor

    def _network(self, calls):
        failure = run_network(calls)
        self.stats["network_failed" if failure else "network"] += len(calls)
        return failure

    # -- reduce-scatter within groups, sum across groups, all-gather -------------------------
    def _groups(self, flat, count, isz, code, sig, network):
        plan, me, seq = self.plan, self.rank, self.seq
        everyone = range(plan.local_size)
        gi, pos = plan.group_of(me)
        members = plan.groups[gi]
        nbytes = count * isz
        s, e = plan.group_slices(me, count)
        staged = self._region(me, "S", nbytes)                                       # STAGE
        copy_into(staged[:s * isz], flat[:s * isz])  # our own slice is read from the tensor itself
        copy_into(staged[e * isz:], flat[e * isz:])
        self.stats["stage"] += 1
        # everyone (not just the group): a mismatched tensor fails on every process at this barrier
        self.group.barrier(seq, _STAGED, everyone, sig, "stage")
        leader = members[0]
        if e > s:                                                                    # REDUCE-SCATTER + D2H
            sum_many(self._region(leader, "H", nbytes)[s * isz:e * isz],
                     [flat[s * isz:e * isz] if r == me else self._region(r, "S", nbytes)[s * isz:e * isz]
                      for r in members], code)
            self.stats["group_reduce"] += 1
        leaders = [g[0] for g in plan.groups]
        a, b = plan.reduce_ranges(count)[me]
        if len(plan.groups) > 1:
            self.group.barrier(seq, _GROUP_SUMMED, everyone, sig, "group sums")
            result = "R", 0
            if b > a:                                                                # PCIE_REDUCE
                sum_many(self._region(0, "R", nbytes)[a * isz:b * isz],
                         [self._region(ld, "H", nbytes)[a * isz:b * isz] for ld in leaders], code)
                self.stats["pcie_reduce"] += 1
        else:
            result = "H", leader  # one group: its host copy is the machine's sum (range r == slice r)
        out = self._region(result[1], result[0], nbytes)
        failure = None
        if network is not None and b > a:
            failure = self._network([(network, (out[a * isz:b * isz].view(_numpy_dtype(code)), a, b, plan.rails[me]))])
        barrier_after_network(self.group, seq, _MACHINE_SUMMED, everyone, sig, "machine sum", failure)
        # COPYH2D + ALL-GATHER: on GPUs each copies its slice back and the group gathers over its switch,
        # so no uplink carries the whole tensor; here all of it is one memory, and one copy beats two
        copy_into(flat, out)
        self.stats["gather"] += 1
        # no barrier here: the next operation's first barrier (everyone) comes before anything but
        # a process's own S is written again, and S is only read before the barrier above

    # -- reduce to roots, broadcast from them -------------------------------------------------
    def _reduce_broadcast(self, flat, count, isz, code, sig, network):
        from .strategy import partition_bounds

        plan, me, seq = self.plan, self.rank, self.seq
        everyone = range(plan.local_size)
        nbytes = count * isz
        copy_into(self._region(me, "S", nbytes), flat)
        self.stats["stage"] += 1
        self.group.barrier(seq, _STAGED, everyone, sig, "stage")
        parts = partition_bounds(count, isz, self.partition_bytes)
        calls = []
        for i, (a, b) in enumerate(parts):
            if plan.root_for(i) != me or b <= a:
                continue
            dst = self._region(me, "H", nbytes)[a * isz:b * isz]                     # REDUCE + D2H at the root
            sum_many(dst, [self._region(r, "S", nbytes)[a * isz:b * isz] for r in everyone], code)
            self.stats["root_reduce"] += 1
            if network is not None:
                calls.append((network, (dst.view(_numpy_dtype(code)), a, b, plan.rails[me])))
        failure = self._network(calls) if calls else None
        barrier_after_network(self.group, seq, _MACHINE_SUMMED, everyone, sig, "reduce", failure)
        for i, (a, b) in enumerate(parts):                                           # BROADCAST
            if b > a:
                copy_into(flat[a * isz:b * isz], self._region(plan.root_for(i), "H", nbytes)[a * isz:b * isz])
        self.stats["gather"] += 1
        # no barrier: the next operation's first one fences the roots' H, as in _groups

    def close(self):
        self.group.close()


def _numpy_dtype(code):
    return dtypes.numpy_view_dtype(code)


def run_network(calls):
    """Run a process's network hooks ``[(fn, args)]``, then the completion callables they return;
    return the exception to report to the other local processes, or None (shared with
    core/gpu_stages.py)."""
    pending, failure = [], None
    for fn, args in calls:
        try:
            pending.append(fn(*args))
        except Exception as e:  # reported to every local process in the next barrier
            failure = e
            break
    try:
        _finish(pending)  # also after a failure: nothing may still write into our buffers
    except Exception as e:
        failure = failure or e
    return failure


def barrier_after_network(group, seq, phase, members, sig, what, failure):
    """A barrier that carries this process's network failure (if any) to the others; the process
    that failed raises its own error, the others LocalPeerError."""
    try:
        group.barrier(seq, phase, members, sig, what,
                      error=None if failure is None else f"{type(failure).__name__}: {failure}")
    except LocalPeerError:
        if failure is not None:
            raise failure from None
        raise


def _finish(results):
    """Call the completion callables some network hooks return (None: the hook finished already).

    Every one is called even after one fails, so nothing is still writing into a buffer when the
    operation ends; the first error is raised."""
    first = None
    for done in results:
        if done is None:
            continue
        try:
            done()
        except Exception as e:
            first = first or e
    if first is not None:
        raise first
