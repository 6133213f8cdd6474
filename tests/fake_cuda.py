"""A CUDA runtime and NCCL that run on the CPU, behind core/gpu.py's ctypes seam (tests only).

``FakeGpu(devices)`` gives ``cudart`` and ``nccl`` objects with the C functions core/gpu.py calls
(``Cuda(fake.cudart)``, ``Nccl(fake.nccl, cuda)``), so the real wrappers and the real GPU stages
run. It models strictly what the GPU stages depend on, so that a mistake fails here the way it
would on a GPU:

* **The current device is per host thread.** ``cudaSetDevice`` sets it for the calling thread only.
  A thread that calls the runtime without having set one works on device 0, as CUDA does; every such
  call is recorded in :attr:`FakeGpu.implicit` (on a GPU it would create a context on GPU 0).
* **Resources belong to a device**: streams and events to the device current when they were
  created, NCCL communicators to the device current in the thread that ran ``ncclCommInitRank``.
  Queuing work on a stream of another device than the calling thread's current one fails
  (``cudaErrorInvalidResourceHandle``), an event can only be recorded on a stream of its device, and
  an NCCL call whose stream is not on the communicator's device fails (``ncclUnhandledCudaError``,
  what a kernel launch on a foreign stream gives).
* **Device memory** is host memory tagged with a device (:meth:`FakeGpu.alloc`); a copy whose device
  pointer is not memory of the stream's device fails (``cudaErrorInvalidValue``).
* **Asynchrony.** Work queued on a stream runs only when the host waits (``cudaEventQuery``,
  ``cudaStreamSynchronize``, ...), one operation per stream per round, in rounds; a kernel queued with
  :meth:`FakeGpu.kernel` and ``delay=k`` holds its stream for k rounds. A stream that does not wait
  (``cudaStreamWaitEvent``) for an event recorded after that kernel reads the memory before the
  kernel wrote it: a missing wait on the producer's stream shows as a wrong result.
* **NCCL collectives** (reduce, broadcast, reduce-scatter, all-gather; sum) match up across the ranks
  of a communicator in issue order and run when every rank's stream has reached its call; group
  calls are accepted.

Every call is logged in :attr:`FakeGpu.calls` as (thread name, current device, function, args).
The ranks of a machine run as threads of one process here (each with its own current device), the
processes of a real machine each have their own runtime.
"""
import ctypes
import os
import threading
from collections import deque

import numpy as np

cudaSuccess, cudaErrorInvalidValue, cudaErrorInvalidDevice, cudaErrorInvalidResourceHandle = 0, 1, 101, 400
cudaErrorNotReady = 600
ncclSuccess, ncclUnhandledCudaError, ncclInvalidArgument, ncclInvalidUsage = 0, 1, 4, 5
D2H, H2D = 2, 1

_NUMPY = {0: np.int8, 1: np.uint8, 2: np.int32, 4: np.int64, 6: np.float16, 7: np.float32, 8: np.float64}


class _Fn:
    """A C function stand-in: callable, and takes ``argtypes``/``restype`` like a ctypes function."""

    def __init__(self, name, impl):
        self.__name__, self.impl = name, impl
        self.argtypes = self.restype = None

    def __call__(self, *args):
        return self.impl(*args)


class _Lib:
    def __init__(self, functions):
        for name, impl in functions.items():
            setattr(self, name, _Fn(name, impl))


def _out(ref, value):
    """Write ``value`` through a ``ctypes.byref(...)`` argument."""
    ref._obj.value = value


class Stream:
    def __init__(self, handle, device, name):
        self.handle, self.device, self.name = handle, device, name
        self.ops = deque()


class Event:
    def __init__(self, handle, device):
        self.handle, self.device = handle, device
        self.recorded = 0   # how many records were queued
        self.completed = 0  # how many of them ran


class Comm:
    def __init__(self, handle, device, nranks, rank, uid):
        self.handle, self.device, self.nranks, self.rank, self.uid = handle, device, nranks, rank, uid
        self.issued = 0  # collectives queued by this rank


class FakeGpu:
    def __init__(self, devices=2):
        self.devices = devices
        self.lock = threading.RLock()
        self.tls = threading.local()
        self.calls = []       #: (thread name, current device, function, args)
        self.implicit = []    #: (thread name, function): runtime used by a thread that set no device
        self.memory = {}      #: base address -> (device, numpy buffer)
        self.streams = {}     #: handle -> Stream (creation order)
        self.events = {}      #: handle -> Event
        self.comms = {}       #: handle -> Comm
        self.registered = {}  #: pinned host address -> bytes
        self._next = 0x1000
        self._default = {}    # (device, thread or None) -> Stream: the legacy (1/0) and per-thread (2) streams
        self._pending = {}    # (uid, index) -> {rank: (stream, call)}: collectives waiting for every rank
        self.cudart = _Lib({n[1:]: getattr(self, n) for n in dir(self) if n.startswith("_cuda")})
        self.nccl = _Lib({n[1:]: getattr(self, n) for n in dir(self) if n.startswith("_nccl")})

    # ------------------------------------------------------------------ test-side helpers

    def alloc(self, device, nbytes, fill=0, dtype=np.uint8):
        """Device memory on ``device``: (address, numpy view of it)."""
        buf = np.full(max(1, nbytes // np.dtype(dtype).itemsize), fill, dtype=dtype)
        with self.lock:
            self.memory[buf.ctypes.data] = (device, buf)
        return buf.ctypes.data, buf

    def stream(self, device, name="producer"):
        """A stream on ``device`` (as torch.cuda.Stream would create)."""
        with self.lock:
            return self._new_stream(device, name).handle

    def kernel(self, stream, fn, delay=0):
        """Queue ``fn()`` on ``stream``; it holds the stream for ``delay`` rounds first (a long kernel)."""
        with self.lock:
            self.streams[stream].ops.append(["kernel", fn, delay])

    def current(self):
        """The calling thread's current device (None: never set)."""
        return getattr(self.tls, "device", None)

    def devices_of(self, function):
        """{(thread name, device)} of the calls to ``function``."""
        return {(t, d) for t, d, f, _ in self.calls if f == function}

    # ------------------------------------------------------------------ model

    def _dev(self, function, *args):
        device = getattr(self.tls, "device", None)
        name = threading.current_thread().name
        if device is None:
            self.implicit.append((name, function))
            device = 0
        self.calls.append((name, device, function, args))
        return device

    def _handle(self):
        self._next += 0x10
        return self._next

    def _new_stream(self, device, name):
        st = Stream(self._handle(), device, name)
        self.streams[st.handle] = st
        return st

    def _resolve(self, handle, device):
        """The Stream of a handle: 0 and 1 are the legacy default stream of ``device``, 2 the calling
        thread's per-thread default stream on it."""
        if handle in (0, 1, None):
            key = (device, None)
        elif handle == 2:
            key = (device, threading.get_ident())
        else:
            return self.streams.get(handle)
        if key not in self._default:
            self._default[key] = self._new_stream(device, f"default{key}")
        return self._default[key]

    def _on_device(self, ptr, nbytes, device):
        for base, (dev, buf) in self.memory.items():
            if base <= ptr and ptr + nbytes <= base + buf.nbytes:
                return dev == device
        return False

    def _satisfied(self, op):
        return op[0] != "wait" or op[1].completed >= op[2]

    def _run(self, st, op):
        kind = op[0]
        if kind == "copy":
            _, dst, src, n = op
            ctypes.memmove(dst, src, n)
        elif kind == "kernel":
            op[1]()
        elif kind == "record":
            op[1].completed = max(op[1].completed, op[2])
        elif kind == "memset":
            ctypes.memset(op[1], op[2], op[3])

    def _progress(self):
        """Run queued work until nothing can move (rounds of one operation per stream)."""
        with self.lock:
            while True:
                moved = False
                for st in list(self.streams.values()):
                    if not st.ops:
                        continue
                    op = st.ops[0]
                    if op[0] == "kernel" and op[2] > 0:
                        op[2] -= 1
                        moved = True
                        continue
                    if op[0] == "nccl":
                        if self._collective(op):
                            moved = True
                        continue
                    if not self._satisfied(op):
                        continue
                    st.ops.popleft()
                    self._run(st, op)
                    moved = True
                if not moved:
                    return

    def _idle(self, st):
        return not st.ops

    # ------------------------------------------------------------------ CUDA runtime

    def _cudaGetDeviceCount(self, ref):
        _out(ref, self.devices)
        return cudaSuccess

    def _cudaSetDevice(self, device):
        self.calls.append((threading.current_thread().name, device, "cudaSetDevice", (device,)))
        if not 0 <= device < self.devices:
            return cudaErrorInvalidDevice
        self.tls.device = device
        return cudaSuccess

    def _cudaGetDevice(self, ref):
        _out(ref, self.current() or 0)
        return cudaSuccess

    def _cudaDeviceGetPCIBusId(self, buf, n, device):
        buf.value = f"0000:{device + 1:02x}:00.0".encode()
        return cudaSuccess

    def _cudaMalloc(self, ref, nbytes):
        with self.lock:
            _out(ref, self.alloc(self._dev("cudaMalloc", nbytes), nbytes)[0])
        return cudaSuccess

    def _cudaFree(self, ptr):
        with self.lock:
            self._dev("cudaFree", ptr)
            self.memory.pop(ptr, None)
        return cudaSuccess

    def _cudaHostAlloc(self, ref, nbytes, flags):
        raise NotImplementedError("cudaHostAlloc is not modelled")

    _cudaFreeHost = _cudaHostAlloc

    def _cudaHostRegister(self, ptr, nbytes, flags):
        with self.lock:
            self._dev("cudaHostRegister", ptr, nbytes)
            self.registered[ptr] = nbytes
        return cudaSuccess

    def _cudaHostUnregister(self, ptr):
        with self.lock:
            self._dev("cudaHostUnregister", ptr)
            return cudaSuccess if self.registered.pop(ptr, None) is not None else cudaErrorInvalidValue

    def _cudaMemcpy(self, dst, src, nbytes, kind):
        with self.lock:
            self._dev("cudaMemcpy", dst, src, nbytes, kind)
            self._progress()
            ctypes.memmove(dst, src, nbytes)
        return cudaSuccess

    def _queue(self, function, stream, op, *args):
        with self.lock:
            device = self._dev(function, stream, *args)
            st = self._resolve(stream, device)
            if st is None or st.device != device:
                return cudaErrorInvalidResourceHandle  # no such stream, or one of another device
            st.ops.append(op)
            return cudaSuccess

    def _cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        with self.lock:
            device = self._dev("cudaMemcpyAsync", stream, dst, src, nbytes, kind)
            st = self._resolve(stream, device)
            if st is None or st.device != device:
                return cudaErrorInvalidResourceHandle  # no such stream, or one of another device
            if not self._on_device(src if kind == D2H else dst, nbytes, st.device):
                return cudaErrorInvalidValue  # the device side is not memory of this device
            st.ops.append(["copy", dst, src, nbytes])
            return cudaSuccess

    def _cudaMemsetAsync(self, ptr, value, nbytes, stream):
        return self._queue("cudaMemsetAsync", stream, ["memset", ptr, value, nbytes], ptr, value, nbytes)

    def _cudaStreamCreateWithFlags(self, ref, flags):
        with self.lock:
            _out(ref, self._new_stream(self._dev("cudaStreamCreateWithFlags", flags), "created").handle)
        return cudaSuccess

    def _cudaStreamDestroy(self, stream):
        with self.lock:
            self._dev("cudaStreamDestroy", stream)
            return cudaSuccess if self.streams.pop(stream, None) is not None else cudaErrorInvalidResourceHandle

    def _cudaStreamSynchronize(self, stream):
        with self.lock:
            st = self._resolve(stream, self._dev("cudaStreamSynchronize", stream))
            self._progress()
            return cudaSuccess if st is not None and not st.ops else cudaErrorInvalidResourceHandle

    def _cudaStreamWaitEvent(self, stream, event, flags):
        with self.lock:
            device = self._dev("cudaStreamWaitEvent", stream, event)
            st, ev = self._resolve(stream, device), self.events.get(event)
            if st is None or ev is None or st.device != device:
                return cudaErrorInvalidResourceHandle
            # waits for the event's most recent record (none yet: nothing to wait for); any device's event
            st.ops.append(["wait", ev, ev.recorded])
            return cudaSuccess

    def _cudaEventCreateWithFlags(self, ref, flags):
        with self.lock:
            ev = Event(self._handle(), self._dev("cudaEventCreateWithFlags", flags))
            self.events[ev.handle] = ev
            _out(ref, ev.handle)
        return cudaSuccess

    def _cudaEventRecord(self, event, stream):
        with self.lock:
            device = self._dev("cudaEventRecord", event, stream)
            st, ev = self._resolve(stream, device), self.events.get(event)
            if st is None or ev is None or ev.device != st.device:
                return cudaErrorInvalidResourceHandle  # "the stream's device must match the event's"
            ev.recorded += 1
            st.ops.append(["record", ev, ev.recorded])
            return cudaSuccess

    def _cudaEventQuery(self, event):
        with self.lock:
            self._dev("cudaEventQuery", event)
            ev = self.events.get(event)
            if ev is None:
                return cudaErrorInvalidResourceHandle
            self._progress()
            return cudaSuccess if ev.completed >= ev.recorded else cudaErrorNotReady

    def _cudaEventDestroy(self, event):
        with self.lock:
            self._dev("cudaEventDestroy", event)
            # queued waits and records keep the Event object: CUDA frees it once they are done
            return cudaSuccess if self.events.pop(event, None) is not None else cudaErrorInvalidResourceHandle

    def _cudaDeviceSynchronize(self):
        with self.lock:
            self._dev("cudaDeviceSynchronize")
            self._progress()
        return cudaSuccess

    def _cudaGetErrorName(self, rc):
        return {0: b"cudaSuccess", 1: b"cudaErrorInvalidValue", 101: b"cudaErrorInvalidDevice",
                400: b"cudaErrorInvalidResourceHandle", 600: b"cudaErrorNotReady"}.get(rc, b"cudaErrorUnknown")

    def _cudaGetErrorString(self, rc):
        return b"fake CUDA error " + self._cudaGetErrorName(rc)

    # ------------------------------------------------------------------ NCCL

    def _ncclGetVersion(self, ref):
        _out(ref, 22105)
        return ncclSuccess

    def _ncclGetUniqueId(self, ref):
        ctypes.memmove(ctypes.addressof(ref._obj), os.urandom(128), 128)
        return ncclSuccess

    def _ncclCommInitRank(self, ref, nranks, uid, rank):
        with self.lock:
            device = self._dev("ncclCommInitRank", nranks, rank)  # NCCL binds the comm to the current device
            comm = Comm(self._handle(), device, nranks, rank, ctypes.string_at(ctypes.addressof(uid), 128))
            self.comms[comm.handle] = comm
            _out(ref, comm.handle)
        return ncclSuccess

    def _ncclCommDestroy(self, comm):
        with self.lock:
            self._dev("ncclCommDestroy", comm)
            return ncclSuccess if self.comms.pop(comm, None) is not None else ncclInvalidArgument

    _ncclCommAbort = _ncclCommDestroy

    def _ncclGroupStart(self):
        self._dev("ncclGroupStart")
        return ncclSuccess

    def _ncclGroupEnd(self):
        self._dev("ncclGroupEnd")
        return ncclSuccess

    def _ncclGetErrorString(self, rc):
        return {1: b"unhandled cuda error", 4: b"invalid argument", 5: b"invalid usage"}.get(rc, b"fake nccl error")

    def _enqueue(self, function, comm, stream, call):
        with self.lock:
            device = self._dev(function, comm, stream, *call[1:])
            c = self.comms.get(comm)
            st = self._resolve(stream, device)
            if c is None or st is None:
                return ncclInvalidArgument
            if st.device != c.device:  # NCCL launches its kernel on the comm's device: a foreign stream fails
                return ncclUnhandledCudaError
            st.ops.append(["nccl", c, c.issued, call])
            c.issued += 1
            return ncclSuccess

    def _ncclReduce(self, send, recv, count, dtype, op, root, comm, stream):
        return self._enqueue("ncclReduce", comm, stream, ("reduce", send, recv, count, dtype, root))

    def _ncclBroadcast(self, send, recv, count, dtype, root, comm, stream):
        return self._enqueue("ncclBroadcast", comm, stream, ("broadcast", send, recv, count, dtype, root))

    def _ncclReduceScatter(self, send, recv, recvcount, dtype, op, comm, stream):
        return self._enqueue("ncclReduceScatter", comm, stream, ("reduce_scatter", send, recv, recvcount, dtype, None))

    def _ncclAllGather(self, send, recv, sendcount, dtype, comm, stream):
        return self._enqueue("ncclAllGather", comm, stream, ("all_gather", send, recv, sendcount, dtype, None))

    def _collective(self, op):
        """Run the collective at the head of a stream once every rank's stream has it at its head."""
        _, comm, index, call = op
        heads = {}
        for st in self.streams.values():
            if st.ops and st.ops[0][0] == "nccl":
                c, i = st.ops[0][1], st.ops[0][2]
                if c.uid == comm.uid and i == index:
                    heads[c.rank] = (st, st.ops[0][3])
        if len(heads) < comm.nranks:
            return False
        kinds = {(h[1][0], h[1][3], h[1][4], h[1][5]) for h in heads.values()}
        if len(kinds) != 1:
            raise AssertionError(f"NCCL calls do not match across ranks: {sorted(kinds, key=str)}")
        kind, count, dtype, root = kinds.pop()
        n = comm.nranks

        def get(ptr, elems):
            """The values at a device address (bfloat16 as float32, exact)."""
            raw = np.ctypeslib.as_array((ctypes.c_ubyte * (elems * _itemsize(dtype))).from_address(ptr))
            if dtype == 9:
                return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            return raw.view(_NUMPY[dtype])

        def put(ptr, elems, values):
            if dtype == 9:  # round to nearest even, as a bfloat16 conversion does
                u = np.asarray(values, np.float32).view(np.uint32)
                values = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
                target = np.ctypeslib.as_array((ctypes.c_ubyte * (elems * 2)).from_address(ptr)).view(np.uint16)
            else:
                target = get(ptr, elems)
            target[:] = values

        sends = {r: get(call[1], count * (n if kind == "reduce_scatter" else 1)).copy()
                 for r, (st, call) in heads.items()}
        for r, (st, call) in heads.items():
            recv = call[2]
            if kind == "reduce" and r == root:
                put(recv, count, sum(sends[q] for q in range(n)))
            elif kind == "broadcast":
                put(recv, count, sends[root])
            elif kind == "reduce_scatter":
                put(recv, count, sum(sends[q][r * count:(r + 1) * count] for q in range(n)))
            elif kind == "all_gather":
                put(recv, count * n, np.concatenate([sends[q] for q in range(n)]))
            st.ops.popleft()
        return True


def _itemsize(nccl_dtype):
    return 2 if nccl_dtype == 9 else np.dtype(_NUMPY[nccl_dtype]).itemsize
