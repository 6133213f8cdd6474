"""GPU stages of a plan: local REDUCE / BROADCAST or REDUCE-SCATTER / ALL-GATHER over NCCL,
COPYD2H / COPYH2D through pinned shared staging buffers, PCIE_REDUCE on the CPU.

One :class:`GpuExecutor` per local process (one process per GPU, local rank r drives
``plan.devices[r]``), all built from the same :class:`~byteps.topology.strategy.Plan`. The steps
follow the BytePS paper (§4.2, §6.1) and use the plan's slicing:

``cpu_assisted`` (PCIe-only, symmetric; also ``reduce_scatter`` with one group of all GPUs, over NVLink)
  1. REDUCE-SCATTER inside the group: ``ncclReduceScatter`` in place, every member holding slice
     ``pos`` of its group's sum; the tail that does not divide evenly goes to the last member with an
     ``ncclReduce`` in the same NCCL group call (:func:`~byteps.topology.strategy.slice_bounds`).
  2. COPYD2H: ``cudaMemcpyAsync`` of that slice into the group's host buffer H (in the group leader's
     shared arena, pinned with ``cudaHostRegister`` in every process that maps it).
  3. PCIE_REDUCE (several groups): local rank r sums range r of the groups' H copies into R with
     ``sum_many`` (nogil), so the CPU, not a cross-switch GPU copy, joins the switches.
  4. network: ``network(view, start, stop, nic)`` on range r (the engine would push/pull here).
  5. COPYH2D of the group slice back, 6. ALL-GATHER in place (+ ``ncclBroadcast`` of the tail).
``reduce_broadcast`` (asymmetric, roots away from the NIC's switch)
  per partition, round-robin over the plan's roots: ``ncclReduce`` to the root, root COPYD2H into
  its H, network, COPYH2D, ``ncclBroadcast`` from the root. Every rank issues the same NCCL calls in
  the same order on one stream, so they match up.
``none``: COPYD2H, network, COPYH2D.

NCCL unique ids travel through shared memory: the lowest rank of each communicator writes
``ncclGetUniqueId`` into the header page of its arena and the others read it after a barrier
(:func:`exchange_ids`), so no file, port or extra socket is needed. All NCCL and copy work runs on
one non-blocking stream per process; host waits poll CUDA events with the executor's time-out.

Threads and devices: the current CUDA device is per host thread, so every entry point
(construction, :meth:`GpuExecutor.push_pull`, :meth:`GpuExecutor.close`) makes this process's GPU
current on the calling thread first, and the communicators are created on it too
(``Nccl.comm_init_rank(device=)``, whose helper thread sets it).

Producers: before the first read, the stream waits (``cudaStreamWaitEvent``) for the work queued
on the tensor's producer stream: the event a hand-over recorded (``DeviceArray.ready_event``: the
torch plugin records one on ``torch.cuda.current_stream()`` at submission), an event recorded now on
``push_pull(stream=)`` or on the ``__cuda_array_interface__`` v3 ``stream``, or, for a tensor whose
interface names no stream (PyTorch's), DLPack with our stream as the consumer's, so the producer
orders its current stream's work before ours.

Status: written to the CUDA runtime and NCCL APIs but not run in this repository's CI (no GPU);
tests/test_gpu_stages.py runs it wherever a GPU and NCCL are present and otherwise skips saying why.
"""
import numpy as np

from byteps.core.shm import PAGE
from byteps.errors import BytePSError
from byteps.topology.localsync import LocalPeerError

from . import dtypes
from ._reduce import sum_many
from .gpu import DeviceArray, cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice, as_device_array, cuda, nccl

ID_BYTES = 128
_SETUP = 0  # barrier sequence number of the set-up phase
_IDS_WRITTEN = 1
_STAGED, _GROUP_SUMMED, _MACHINE_SUMMED, _COPIED_BACK, _DONE = range(1, 6)


def cuda_ordinal(gpu_index, env=None):
    """The CUDA device ordinal of machine GPU ``gpu_index`` in this process: its position in a numeric
    CUDA_VISIBLE_DEVICES (the plan's GPU indices are the machine's, in PCI order), else the index."""
    import os

    raw = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    ids = [p.strip() for p in (raw or "").split(",") if p.strip()]
    if ids and all(p.isdigit() for p in ids) and str(gpu_index) in ids:
        return ids.index(str(gpu_index))
    return gpu_index


def communicators(plan):
    """[(header slot, member local ranks)] of the NCCL communicators the plan needs."""
    if plan.local_size == 1 or plan.strategy == "none":
        return []
    if plan.strategy in ("reduce_broadcast", "reduce_scatter"):
        return [(0, tuple(range(plan.local_size)))]
    return [(1 + gi, tuple(members)) for gi, members in enumerate(plan.groups) if len(members) > 1]


def exchange_ids(group, comms, make_id):
    """Give every communicator's members one unique id, created by its lowest rank.

    ``group``: the machine's LocalGroup (its arena's first page is the id header). ``comms``:
    from :func:`communicators`. ``make_id()``: ``Nccl.get_unique_id`` (any 128-byte source in
    tests). Returns {slot: id bytes} for the communicators this rank belongs to."""
    if len(comms) * ID_BYTES > PAGE:
        raise BytePSError(f"{len(comms)} communicators do not fit the {PAGE}-byte id header")
    me = group.rank
    for slot, members in comms:
        if me == min(members):
            uid = make_id()
            if len(uid) != ID_BYTES:
                raise BytePSError(f"NCCL unique id of {len(uid)} bytes, expected {ID_BYTES}")
            group.peers[me][slot * ID_BYTES:(slot + 1) * ID_BYTES] = np.frombuffer(uid, dtype=np.uint8)
    group.barrier(_SETUP, _IDS_WRITTEN, range(group.size), what="NCCL unique id exchange")
    out = {}
    for slot, members in comms:
        if me in members:
            out[slot] = group.peers[min(members)][slot * ID_BYTES:(slot + 1) * ID_BYTES].tobytes()
    return out


class GpuExecutor:
    """One local process's GPU stages for ``plan`` (see the module docstring).

    Args:
        plan: a "gpu" Plan, the same on every local process.
        local_rank: this process's local rank; it drives GPU ``plan.devices[local_rank]``.
        token: shared by the machine's processes and unique to the job (LocalGroup).
        capacity: the largest tensor in bytes.
        timeout: seconds any wait (barrier, NCCL init, GPU work) may last.
        partition_bytes: partition size for reduce_broadcast.
    """

    def __init__(self, plan, local_rank, token, capacity, timeout=30.0, partition_bytes=4096000):
        from byteps.topology.localsync import LocalGroup

        if plan.device != "gpu":
            raise BytePSError(f"GpuExecutor needs a GPU plan; this machine's plan is {plan.device}-only")
        self.plan, self.rank, self.timeout = plan, local_rank, float(timeout)
        self.partition_bytes = partition_bytes
        self.cuda = cuda()
        self.nccl = nccl() if communicators(plan) else None
        self.device = cuda_ordinal(plan.devices[local_rank])
        self.cuda.set_device(self.device)  # this thread's; push_pull and close set it on theirs
        self.cap = max(PAGE, -(-capacity // PAGE) * PAGE)
        # arena: id header page | H (group / root host buffer) | R (machine sum)
        self.group = LocalGroup(token, local_rank, plan.local_size, PAGE + 2 * self.cap, timeout)
        self.pinned = []
        self.comms = {}
        self.stream = self.event = None
        try:
            for rank in range(plan.local_size):  # DMA to and from every arena we touch
                arr = self.group.peers[rank]
                self.cuda.host_register(arr.ctypes.data, arr.size)
                self.pinned.append(arr.ctypes.data)
            self.stream = self.cuda.stream_create()
            self.event = self.cuda.event_create()
            comms = communicators(plan)
            ids = exchange_ids(self.group, comms, self.nccl.get_unique_id if self.nccl else None)
            for slot, members in comms:
                if local_rank in members:
                    self.comms[slot] = self.nccl.comm_init_rank(len(members), ids[slot], members.index(local_rank),
                                                                timeout, device=self.device)
        except BaseException:
            self.close()
            raise
        self.seq = 0
        self.tag = 0

    # -- helpers -------------------------------------------------------------------------------
    def _host(self, rank, which):
        """(numpy uint8 view, address) of a rank's H or R region."""
        base = PAGE + {"H": 0, "R": 1}[which] * self.cap
        view = self.group.peers[rank][base:base + self.cap]
        return view, view.ctypes.data

    def _wait(self, what):
        self.cuda.event_record(self.event, self.stream)
        self.cuda.event_wait(self.event, self.timeout, what)

    def _after_producer(self, arr, stream):
        """Make our stream wait for the work queued on the tensor's producer stream(s) so far."""
        if arr.ready_event:  # recorded at the hand-over, on the producer's thread
            self.cuda.stream_wait_event(self.stream, arr.ready_event)
        for producer in dict.fromkeys(s for s in (stream, arr.stream) if s is not None):
            # CAI v3: 1 and 2 are the legacy and per-thread default streams (valid here: this is the
            # thread that took the tensor in); 0 is not allowed by the spec, and is the legacy one to CUDA
            event = self.cuda.event_create()
            try:
                self.cuda.event_record(event, producer)
                self.cuda.stream_wait_event(self.stream, event)
            finally:
                self.cuda.event_destroy(event)  # legal once the wait is queued: CUDA frees it when done

    def _comm_for(self, rank):
        if self.plan.strategy == "cpu_assisted":
            gi, _ = self.plan.group_of(rank)
            return self.comms.get(1 + gi)
        return self.comms.get(0)

    # -- the operation -------------------------------------------------------------------------
    def push_pull(self, tensor, network=None, tag=0, stream=None):
        """Sum a CUDA tensor over the machine's GPUs in place; ``network`` and ``tag`` as in
        core/local_exec.py gives them (a hook may return a callable that finishes its work; a failing hook is
        reported to every local process in the next barrier). ``tensor`` may also be a
        :class:`~byteps.core.gpu.DeviceArray` (core/local_exec.py passes slices of a large tensor;
        its ``ready_event`` is waited for). ``stream``: the producer's stream (a ``cudaStream_t`` as
        an int, e.g. ``torch.cuda.current_stream().cuda_stream``), whose work queued so far must
        finish before the stages read the tensor; an event is recorded on it now, on this thread.

        The calling thread's current CUDA device becomes this executor's."""
        self.cuda.set_device(self.device)
        if isinstance(tensor, DeviceArray):
            arr = tensor
        else:
            arr = as_device_array(tensor, stream=self.stream)  # DLPack producers order their work before ours
        if arr.device_type != "cuda":
            raise BytePSError(f"GpuExecutor.push_pull needs a CUDA tensor, got a {arr.device_type} one")
        if arr.nbytes > self.cap:
            raise BytePSError(f"tensor of {arr.nbytes} bytes exceeds the staging capacity of {self.cap} bytes")
        self._after_producer(arr, stream)
        self.seq += 1
        self.tag = tag
        strategy = self.plan.strategy
        if strategy == "none" or self.plan.local_size == 1:
            self._alone(arr, network)
        elif strategy == "reduce_broadcast":
            self._reduce_broadcast(arr, network)
        else:
            self._groups(arr, network)
        return tensor

    def _alone(self, arr, network):
        view, addr = self._host(self.rank, "H")
        self.cuda.memcpy_async(addr, arr.ptr, arr.nbytes, cudaMemcpyDeviceToHost, self.stream)
        self._wait("COPYD2H")
        if network is not None:
            failure = run_network([(network, (view[:arr.nbytes].view(dtypes.numpy_view_dtype(arr.dtype)), 0,
                                                arr.count, self.plan.rails[0]))])
            if failure is not None:
                raise failure
        self.cuda.memcpy_async(arr.ptr, addr, arr.nbytes, cudaMemcpyHostToDevice, self.stream)
        self._wait("COPYH2D")

    def _groups(self, arr, network):
        plan, me, seq, cu, nc = self.plan, self.rank, self.seq, self.cuda, self.nccl
        code, count, isz = arr.dtype, arr.count, dtypes.itemsize(arr.dtype)
        sig = (arr.nbytes, code, self.tag)
        everyone = range(plan.local_size)
        gi, pos = plan.group_of(me)
        members = plan.groups[gi]
        n = len(members)
        q = count // n
        tail = count - n * q
        comm = self._comm_for(me)
        self.group.barrier(seq, _STAGED, everyone, sig, "stage")  # same tensor everywhere before NCCL
        if n > 1:                                                                         # REDUCE-SCATTER
            nc.group_start()
            try:
                if q:
                    nc.reduce_scatter(arr.ptr, arr.ptr + pos * q * isz, q, code, comm, self.stream)
                if tail:
                    t = arr.ptr + n * q * isz
                    nc.reduce(t, t, tail, code, n - 1, comm, self.stream)
            finally:
                nc.group_end()
        s, e = plan.group_slices(me, count)
        leader = members[0]
        h_view, h_addr = self._host(leader, "H")
        cu.memcpy_async(h_addr + s * isz, arr.ptr + s * isz, (e - s) * isz, cudaMemcpyDeviceToHost, self.stream)
        self._wait("REDUCE-SCATTER + COPYD2H")                                            # COPYD2H
        a, b = plan.reduce_ranges(count)[me]
        if len(plan.groups) > 1:
            self.group.barrier(seq, _GROUP_SUMMED, everyone, sig, "group sums")
            out_view, out_addr = self._host(0, "R")
            if b > a:                                                                     # PCIE_REDUCE
                sum_many(out_view[a * isz:b * isz],
                         [self._host(g[0], "H")[0][a * isz:b * isz] for g in plan.groups], code)
        else:
            out_view, out_addr = h_view, h_addr
        failure = None
        if network is not None and b > a:
            failure = run_network([(network, (out_view[a * isz:b * isz].view(dtypes.numpy_view_dtype(code)), a, b,
                                                plan.rails[me]))])
        barrier_after_network(self.group, seq, _MACHINE_SUMMED, range(self.plan.local_size), sig, "machine sum",
                              failure)
        cu.memcpy_async(arr.ptr + s * isz, out_addr + s * isz, (e - s) * isz, cudaMemcpyHostToDevice, self.stream)
        if n > 1:                                                                         # COPYH2D + ALL-GATHER
            nc.group_start()
            try:
                if q:
                    nc.all_gather(arr.ptr + pos * q * isz, arr.ptr, q, code, comm, self.stream)
                if tail:
                    t = arr.ptr + n * q * isz
                    nc.broadcast(t, t, tail, code, n - 1, comm, self.stream)
            finally:
                nc.group_end()
        self._wait("COPYH2D + ALL-GATHER")
        self.group.barrier(seq, _DONE, everyone, sig, "gather")  # host buffers free for the next operation

    def _reduce_broadcast(self, arr, network):
        from byteps.topology.strategy import partition_bounds

        plan, me, seq, cu, nc = self.plan, self.rank, self.seq, self.cuda, self.nccl
        code, count, isz = arr.dtype, arr.count, dtypes.itemsize(arr.dtype)
        sig = (arr.nbytes, code, self.tag)
        everyone = range(plan.local_size)
        comm = self.comms[0]
        self.group.barrier(seq, _STAGED, everyone, sig, "stage")
        parts = [(i, a, b) for i, (a, b) in enumerate(partition_bounds(count, isz, self.partition_bytes)) if b > a]
        h_view, h_addr = self._host(me, "H")
        for i, a, b in parts:                                                             # REDUCE (+ root COPYD2H)
            root = plan.root_for(i)
            p = arr.ptr + a * isz
            nc.reduce(p, p, b - a, code, root, comm, self.stream)
            if root == me:
                cu.memcpy_async(h_addr + a * isz, p, (b - a) * isz, cudaMemcpyDeviceToHost, self.stream)
        self._wait("REDUCE + COPYD2H")
        failure = None
        if network is not None:
            failure = run_network([(network, (h_view[a * isz:b * isz].view(dtypes.numpy_view_dtype(code)), a, b,
                                                plan.rails[me])) for i, a, b in parts if plan.root_for(i) == me])
        # the roots' network results are needed before the broadcast: everyone learns of a failure here
        barrier_after_network(self.group, seq, _MACHINE_SUMMED, range(self.plan.local_size), sig, "reduce", failure)
        for i, a, b in parts:                                                             # (root COPYH2D +) BROADCAST
            root = plan.root_for(i)
            p = arr.ptr + a * isz
            if root == me:
                cu.memcpy_async(p, h_addr + a * isz, (b - a) * isz, cudaMemcpyHostToDevice, self.stream)
            nc.broadcast(p, p, b - a, code, root, comm, self.stream)
        self._wait("COPYH2D + BROADCAST")
        self.group.barrier(seq, _DONE, everyone, sig, "broadcast")

    def close(self):
        try:
            self.cuda.set_device(self.device)  # the resources below belong to our GPU
        except BytePSError:
            pass
        for comm in self.comms.values():
            try:
                self.nccl.comm_destroy(comm)
            except BytePSError:
                pass
        self.comms = {}
        for handle, destroy in ((self.event, self.cuda.event_destroy), (self.stream, self.cuda.stream_destroy)):
            if handle:
                try:
                    destroy(handle)
                except BytePSError:
                    pass
        self.event = self.stream = None
        for ptr in self.pinned:
            try:
                self.cuda.host_unregister(ptr)
            except BytePSError:
                pass
        self.pinned = []
        if getattr(self, "group", None) is not None:
            self.group.close()
            self.group = None


def run_network(calls):
    """Run a process's network hooks ``[(fn, args)]``, then the completion callables they return;
    return the exception to report to the other local processes, or None."""
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
