"""GPU building blocks: the CUDA runtime and NCCL through ctypes, device-pointer intake, pinned staging.

The core is not compiled against CUDA, NCCL or any framework: ``libcudart`` and ``libnccl`` are
opened with ctypes when first used (system paths, ``LD_LIBRARY_PATH``, or the ``nvidia-*`` pip
wheels that PyTorch installs), and tensors are taken through ``__cuda_array_interface__`` or
DLPack, so ``import byteps.core.gpu`` works on any machine and every GPU test can say why it
skips (:func:`unavailable_reason`).

Pieces (used by core/gpu_stages.py):

* :class:`Cuda`: device selection, ``cudaHostRegister`` pinning,
  ``cudaMemcpyAsync`` D2H/H2D on a dedicated non-blocking stream, events polled with a time-out
  (``cudaEventSynchronize`` has none), ``cudaStreamWaitEvent`` to follow a producer's stream.
* :class:`Nccl`: ``ncclGetUniqueId``, ``ncclCommInitRank`` (run in a helper thread so the wait for
  the other ranks has a time-out), ``ncclReduce``, ``ncclBroadcast``, ``ncclReduceScatter``,
  ``ncclAllGather``, group calls. Signatures from nccl.h (NCCL 2.x); dtype enums map from
  byteps.core.dtypes.
* :func:`as_device_array`: (pointer, bytes, dtype, device, stream) from a tensor, keeping the
  producer alive; C-contiguity is checked, not assumed.

**The current device is per host thread.** CUDA keeps one current device per thread, and a thread
that never called ``cudaSetDevice`` works on device 0 (creating a context there). So every thread
that issues CUDA or NCCL calls sets its device first: the GPU stages on each call
(``GpuExecutor``), and :meth:`Nccl.comm_init_rank`'s helper thread, which would otherwise bind the
communicator to GPU 0 in every process.

**Producer streams.** A tensor may still be written by work queued on the stream that produced it
(the backward kernel of a gradient). ``__cuda_array_interface__`` v3 names that stream in its
``stream`` entry (CuPy, Numba); PyTorch (2.13) exports version 2 with no ``stream`` at all, so its
tensors arrive without one. Whoever hands a tensor over therefore records a CUDA event on the
producer's stream on the producer's thread (``DeviceArray.ready_event``; the torch plugin records
one on ``torch.cuda.current_stream()``), and the GPU stages' stream waits for it
(``cudaStreamWaitEvent``) before it reads.

The libraries are reached only through :func:`cuda` and :func:`nccl`; tests/fake_cuda.py puts a
CUDA runtime and NCCL that run on the CPU behind that seam (``Cuda(lib)``, ``Nccl(lib)``) to check
the rules above without a GPU.
"""
import ctypes
import ctypes.util
import dataclasses
import glob
import os
import sys
import threading
import time
from typing import Optional

from byteps.errors import BytePSError, BytePSTimeoutError

from . import dtypes

# ---------------------------------------------------------------------------------------
# constants (cuda_runtime_api.h / driver_types.h, nccl.h)

cudaSuccess = 0
cudaErrorNotReady = 600
cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice = 1, 2, 3
cudaHostRegisterPortable = 0x01
cudaStreamNonBlocking = 0x01
cudaEventDisableTiming = 0x02

NCCL_UNIQUE_ID_BYTES = 128
ncclSuccess, ncclInProgress = 0, 7
ncclSum = 0
#: byteps dtype code -> ncclDataType_t
NCCL_DTYPE = {dtypes.INT8: 0, dtypes.UINT8: 1, dtypes.INT32: 2, dtypes.INT64: 4, dtypes.FLOAT16: 6,
              dtypes.FLOAT32: 7, dtypes.FLOAT64: 8, dtypes.BFLOAT16: 9}

_PAGE = 4096


class GpuError(BytePSError):
    """A CUDA or NCCL call failed, or no GPU stack is available."""


class CudaError(GpuError):
    pass


class NcclError(GpuError):
    pass


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


# ---------------------------------------------------------------------------------------
# finding the libraries


def pip_lib_dirs():
    """lib/ folders of the nvidia-* wheels (nvidia/cuda_runtime/lib, nvidia/nccl/lib, ...)."""
    dirs = []
    for entry in sys.path:
        dirs += glob.glob(os.path.join(entry, "nvidia", "*", "lib"))
    return dirs


def wheel_libraries(stem):
    """lib<stem>.so* of the nvidia-* wheels (PyTorch's CUDA runtime, NCCL), newest name first per folder."""
    return [path for d in pip_lib_dirs() for path in sorted(glob.glob(os.path.join(d, f"lib{stem}.so*")), reverse=True)]


def library_candidates(stem, sonames=(), configured=""):
    """Where lib<stem> is looked for, in order: ``configured`` (BYTEPS_CUDART), PyTorch's nvidia-* wheels
    (the runtime torch itself loads), the system's (``ctypes.util.find_library``), then bare ``sonames``.
    The native core's copy stages and this module's loader take the same order, so that a process holds
    one CUDA runtime."""
    names = [configured] if configured else []
    names += wheel_libraries(stem)
    found = ctypes.util.find_library(stem)
    if found:
        names.append(found)
    return names + [s for s in sonames if s not in names]


def _open(stem, sonames, configured=""):
    """ctypes.CDLL of the first library that loads (library_candidates); GpuError listing what was tried."""
    tried = []
    for name in library_candidates(stem, sonames, configured):
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            tried.append(f"{name} ({e})" if os.sep in name else name)
    raise GpuError(f"lib{stem} not found (tried {', '.join(tried) or 'nothing'}); install the CUDA runtime / "
                   f"NCCL, or a CUDA build of PyTorch that ships them")


_LOCK = threading.Lock()
_CUDA = None
_NCCL = None


def cuda():
    """The process's :class:`Cuda` (loaded once); GpuError if the runtime is missing."""
    global _CUDA
    with _LOCK:
        if _CUDA is None:
            _CUDA = Cuda(_open("cudart", ["libcudart.so", "libcudart.so.12", "libcudart.so.11.0"],
                               os.environ.get("BYTEPS_CUDART", "").strip()))
        return _CUDA


def nccl():
    """The process's :class:`Nccl` (loaded once); GpuError if NCCL is missing."""
    global _NCCL
    with _LOCK:
        loaded = _NCCL
    if loaded is None:
        rt = cuda()  # its helper threads set their device through the runtime
        with _LOCK:
            if _NCCL is None:
                _NCCL = Nccl(_open("nccl", ["libnccl.so", "libnccl.so.2"]), rt)
            loaded = _NCCL
    return loaded


def unavailable_reason(need_nccl=True, min_devices=1):
    """None when CUDA (and NCCL) work with at least ``min_devices`` GPUs, else why not ("no CUDA
    device: ..."), the text GPU tests skip with."""
    try:
        rt = cuda()
    except GpuError as e:
        return f"no CUDA device: {e}"
    count, why = rt.device_count_or_reason()
    if count < min_devices:
        return f"no CUDA device: {why}" if count == 0 else f"needs {min_devices} CUDA devices, found {count}"
    if need_nccl:
        try:
            nccl()
        except GpuError as e:
            return f"no NCCL: {e}"
    return None


# ---------------------------------------------------------------------------------------
# CUDA runtime


_vp, _sz, _int, _uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint


class Cuda:
    """The CUDA runtime calls byteps uses (each raises CudaError with the runtime's message)."""

    _SIGS = {
        "cudaGetDeviceCount": [ctypes.POINTER(_int)],
        "cudaSetDevice": [_int],
        "cudaGetDevice": [ctypes.POINTER(_int)],
        "cudaHostRegister": [_vp, _sz, _uint],
        "cudaHostUnregister": [_vp],
        "cudaMemcpyAsync": [_vp, _vp, _sz, _int, _vp],
        "cudaMemsetAsync": [_vp, _int, _sz, _vp],
        "cudaStreamCreateWithFlags": [ctypes.POINTER(_vp), _uint],
        "cudaStreamDestroy": [_vp],
        "cudaStreamWaitEvent": [_vp, _vp, _uint],
        "cudaEventCreateWithFlags": [ctypes.POINTER(_vp), _uint],
        "cudaEventRecord": [_vp, _vp],
        "cudaEventQuery": [_vp],
        "cudaEventDestroy": [_vp],
        "cudaDeviceSynchronize": [],
    }

    def __init__(self, lib):
        self.lib = lib
        for name, args in self._SIGS.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = _int
        lib.cudaGetErrorString.argtypes = [_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorName.argtypes = [_int]
        lib.cudaGetErrorName.restype = ctypes.c_char_p

    def error_text(self, rc):
        return f"{self.lib.cudaGetErrorName(rc).decode()} ({rc}): {self.lib.cudaGetErrorString(rc).decode()}"

    def check(self, rc, what):
        if rc != cudaSuccess:
            raise CudaError(f"{what} failed: {self.error_text(rc)}")

    def device_count_or_reason(self):
        n = _int(0)
        rc = self.lib.cudaGetDeviceCount(ctypes.byref(n))
        if rc != cudaSuccess:
            return 0, f"cudaGetDeviceCount: {self.error_text(rc)}"
        return n.value, "cudaGetDeviceCount found 0 devices" if n.value == 0 else ""

    def device_count(self):
        return self.device_count_or_reason()[0]

    def set_device(self, index):
        """Make device ``index`` current for the calling thread (and only for it)."""
        self.check(self.lib.cudaSetDevice(index), f"cudaSetDevice({index})")

    def get_device(self):
        d = _int(0)
        self.check(self.lib.cudaGetDevice(ctypes.byref(d)), "cudaGetDevice")
        return d.value

    # -- memory ------------------------------------------------------------------------------
    def host_register(self, ptr, nbytes):
        """Pin existing page-aligned memory (e.g. a shared memfd arena) for DMA."""
        if ptr % _PAGE:
            raise CudaError(f"cudaHostRegister: address {ptr:#x} is not page-aligned")
        self.check(self.lib.cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable), f"cudaHostRegister({nbytes})")

    def host_unregister(self, ptr):
        self.check(self.lib.cudaHostUnregister(ptr), "cudaHostUnregister")

    def memcpy_async(self, dst, src, nbytes, kind, stream):
        if nbytes:
            self.check(self.lib.cudaMemcpyAsync(dst, src, nbytes, kind, stream),
                       f"cudaMemcpyAsync({'D2H' if kind == cudaMemcpyDeviceToHost else 'H2D' if kind == 1 else kind}, "
                       f"{nbytes} bytes)")

    # -- streams and events ------------------------------------------------------------------
    def stream_create(self):
        s = _vp()
        self.check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(s), cudaStreamNonBlocking), "cudaStreamCreate")
        return s.value

    def stream_destroy(self, stream):
        self.check(self.lib.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def stream_wait_event(self, stream, event):
        self.check(self.lib.cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")

    def event_create(self):
        e = _vp()
        self.check(self.lib.cudaEventCreateWithFlags(ctypes.byref(e), cudaEventDisableTiming), "cudaEventCreate")
        return e.value

    def event_record(self, event, stream):
        self.check(self.lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def event_done(self, event):
        rc = self.lib.cudaEventQuery(event)
        if rc == cudaErrorNotReady:
            return False
        self.check(rc, "cudaEventQuery")
        return True

    def event_wait(self, event, timeout, what):
        """Wait for an event, polling with back-off; BytePSTimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while not self.event_done(event):
            if time.monotonic() > deadline:
                raise BytePSTimeoutError(f"{what}: the GPU work did not finish within {timeout:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def event_destroy(self, event):
        self.check(self.lib.cudaEventDestroy(event), "cudaEventDestroy")


# ---------------------------------------------------------------------------------------
# NCCL


class Nccl:
    """The NCCL calls byteps uses (each raises NcclError with NCCL's message)."""

    def __init__(self, lib, cuda=None):
        self.lib = lib
        self.cuda = cuda  #: the runtime the helper threads set their device with (default: :func:`cuda`)
        sigs = {
            "ncclGetVersion": [ctypes.POINTER(_int)],
            "ncclGetUniqueId": [ctypes.POINTER(ncclUniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(_vp), _int, ncclUniqueId, _int],
            "ncclCommDestroy": [_vp],
            "ncclReduce": [_vp, _vp, _sz, _int, _int, _int, _vp, _vp],
            "ncclBroadcast": [_vp, _vp, _sz, _int, _int, _vp, _vp],
            "ncclReduceScatter": [_vp, _vp, _sz, _int, _int, _vp, _vp],
            "ncclAllGather": [_vp, _vp, _sz, _int, _vp, _vp],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = _int
        lib.ncclGetErrorString.argtypes = [_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p

    def check(self, rc, what):
        if rc != ncclSuccess:
            raise NcclError(f"{what} failed: {self.lib.ncclGetErrorString(rc).decode()} ({rc})")

    def version(self):
        v = _int(0)
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def get_unique_id(self):
        uid = ncclUniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)  # .internal would stop at a NUL

    def comm_init_rank(self, nranks, unique_id, rank, timeout, device=None):
        """ncclCommInitRank on CUDA device ``device`` (default: the calling thread's current one), which
        blocks until all ``nranks`` joined, bounded by ``timeout`` s.

        The call runs in a helper thread: NCCL has no time-out of its own, and a rank that never
        comes must not hang this process (the thread is left behind; the process is failing).
        NCCL binds the communicator to the device current *in the thread that calls it*, and a new
        thread's is device 0: the helper sets ``device`` first."""
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise NcclError(f"NCCL unique id of {len(unique_id)} bytes, expected {NCCL_UNIQUE_ID_BYTES}")
        rt = self.cuda or cuda()
        if device is None:
            device = rt.get_device()
        uid = ncclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, NCCL_UNIQUE_ID_BYTES)
        comm = _vp()
        result = {}

        def init():
            try:
                rt.set_device(device)
                result["rc"] = self.lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank)
            except BaseException as e:  # raised on the caller's thread below
                result["error"] = e

        t = threading.Thread(target=init, name="byteps-nccl-init", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise BytePSTimeoutError(f"ncclCommInitRank (rank {rank} of {nranks}) waited {timeout:g} s for the other "
                                     "ranks of the communicator")
        if "error" in result:
            raise result["error"]
        self.check(result["rc"], f"ncclCommInitRank(rank {rank} of {nranks}, CUDA device {device})")
        return comm.value

    def comm_destroy(self, comm):
        self.check(self.lib.ncclCommDestroy(comm), "ncclCommDestroy")

    def reduce(self, send, recv, count, dtype, root, comm, stream):
        self.check(self.lib.ncclReduce(send, recv, count, NCCL_DTYPE[dtype], ncclSum, root, comm, stream),
                   f"ncclReduce({count} x {dtypes.name(dtype)}, root {root})")

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        self.check(self.lib.ncclBroadcast(send, recv, count, NCCL_DTYPE[dtype], root, comm, stream),
                   f"ncclBroadcast({count} x {dtypes.name(dtype)}, root {root})")

    def reduce_scatter(self, send, recv, recvcount, dtype, comm, stream):
        self.check(self.lib.ncclReduceScatter(send, recv, recvcount, NCCL_DTYPE[dtype], ncclSum, comm, stream),
                   f"ncclReduceScatter({recvcount} x {dtypes.name(dtype)} per rank)")

    def all_gather(self, send, recv, sendcount, dtype, comm, stream):
        self.check(self.lib.ncclAllGather(send, recv, sendcount, NCCL_DTYPE[dtype], comm, stream),
                   f"ncclAllGather({sendcount} x {dtypes.name(dtype)} per rank)")

    def group_start(self):
        self.check(self.lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self):
        self.check(self.lib.ncclGroupEnd(), "ncclGroupEnd")


# ---------------------------------------------------------------------------------------
# tensors in: __cuda_array_interface__ and DLPack


@dataclasses.dataclass
class DeviceArray:
    """A tensor's memory as the stages see it. ``owner`` keeps the producer alive while in use."""

    ptr: int
    nbytes: int
    dtype: int  #: byteps.core.dtypes code
    count: int
    device_type: str  #: "cuda" | "cpu" | "cuda_host"
    device: Optional[int]  #: CUDA device ordinal when known (DLPack), else None
    #: producer stream named by the tensor (__cuda_array_interface__ v3 ``stream``), None if none (torch:
    #: always None). Whoever takes the array in records an event on it on the taking thread.
    stream: Optional[int]
    owner: object = None  #: keeps the producer (and ``ready_event``'s owner) alive
    #: a cudaEvent_t recorded on the producer's stream when the tensor was handed over (on the
    #: producer's thread); the GPU stages' stream waits for it before reading. None: nothing to wait for.
    ready_event: Optional[int] = None


#: __cuda_array_interface__ typestr -> byteps dtype code
_TYPESTR = {"<f4": dtypes.FLOAT32, "<f8": dtypes.FLOAT64, "<f2": dtypes.FLOAT16, "<i4": dtypes.INT32,
            "<i8": dtypes.INT64, "|u1": dtypes.UINT8, "|i1": dtypes.INT8, "<u1": dtypes.UINT8, "<i1": dtypes.INT8}
#: raw typestrs: bytes of a type numpy's typestr cannot name. PyTorch exports bfloat16 as "<V2" (as
#: ml_dtypes does); only a caller that knows the dtype (``as_device_array(..., dtype=)``) can take them
_RAW_TYPESTR = {"<V2": 2, "|V2": 2}
#: DLPack (type code, bits) -> byteps dtype code
_DLPACK_DTYPE = {(2, 32): dtypes.FLOAT32, (2, 64): dtypes.FLOAT64, (2, 16): dtypes.FLOAT16, (4, 16): dtypes.BFLOAT16,
                 (0, 32): dtypes.INT32, (0, 64): dtypes.INT64, (1, 8): dtypes.UINT8, (0, 8): dtypes.INT8}
_DLPACK_DEVICE = {1: "cpu", 2: "cuda", 3: "cuda_host"}


def _contiguous(shape, strides, itemsize):
    """True when ``strides`` (bytes) describe a C-contiguous layout of ``shape``."""
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expect:
            return False
        expect *= dim
    return True


def _cai_dtype(cai, dtype):
    """The byteps dtype code of an interface's typestr, given the caller's ``dtype`` (or None); None when
    the typestr alone cannot tell (a raw "<V2" without ``dtype``) or is not supported."""
    typestr = cai.get("typestr")
    code = _TYPESTR.get(typestr)
    if dtype is None:
        return code
    if code is None and _RAW_TYPESTR.get(typestr) == dtypes.itemsize(dtype):
        return dtype  # torch bfloat16 ("<V2"): the caller knows the dtype
    if code is not None and code != dtype:
        raise TypeError(f"__cuda_array_interface__ typestr {typestr!r} is {dtypes.name(code)}, but the tensor's dtype "
                        f"is {dtypes.name(dtype)}")
    return code


def _from_cai(obj, cai, code):
    typestr = cai.get("typestr")
    if code is None:
        raise TypeError(f"__cuda_array_interface__ typestr {typestr!r} is not supported "
                        f"(supported: {', '.join(sorted(_TYPESTR))}; a raw {'/'.join(sorted(_RAW_TYPESTR))} such as "
                        "torch's bfloat16 needs the dtype (as_device_array(..., dtype=)) or DLPack)")
    isz = dtypes.itemsize(code)
    shape = tuple(cai["shape"])
    count = 1
    for d in shape:
        count *= d
    strides = cai.get("strides")
    if strides is not None and not _contiguous(shape, strides, isz):
        raise ValueError(f"tensor of shape {shape} with strides {tuple(strides)} is not C-contiguous; "
                         "pass .contiguous()")
    ptr, _readonly = cai["data"]
    stream = cai.get("stream")
    return DeviceArray(int(ptr or 0), count * isz, code, count, "cuda", None, None if stream is None else int(stream),
                       obj)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj, stream=None):
    """Borrow a DLPack capsule: read its DLTensor, keep the capsule (and so the tensor) alive.

    The capsule is not renamed to "used_dltensor": when it is garbage-collected the producer's
    destructor releases the tensor, as for an unconsumed capsule."""
    if stream is not None and hasattr(obj, "__dlpack_device__") and obj.__dlpack_device__()[0] not in (2, 3):
        stream = None  # the consumer stream is for CUDA memory (kDLCUDA, kDLCUDAHost); numpy refuses one
    try:
        capsule = obj.__dlpack__() if stream is None else obj.__dlpack__(stream=stream)
    except TypeError:  # a producer older than the stream argument
        capsule = obj.__dlpack__()
    ptr = _capsule_pointer(capsule, b"dltensor")
    t = _DLTensor.from_address(ptr)  # DLManagedTensor starts with its DLTensor
    key = (t.dtype.code, t.dtype.bits)
    if key not in _DLPACK_DTYPE or t.dtype.lanes != 1:
        raise TypeError(f"DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits, {t.dtype.lanes} lanes) "
                        "is not supported")
    code = _DLPACK_DTYPE[key]
    isz = dtypes.itemsize(code)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    count = 1
    for d in shape:
        count *= d
    if t.strides:
        strides = tuple(t.strides[i] * isz for i in range(t.ndim))  # DLPack strides are in elements
        if not _contiguous(shape, strides, isz):
            raise ValueError(f"tensor of shape {shape} with strides {tuple(s // isz for s in strides)} (elements) "
                             "is not C-contiguous; pass .contiguous()")
    device_type = _DLPACK_DEVICE.get(t.device.device_type, f"dlpack-device-{t.device.device_type}")
    return DeviceArray((t.data or 0) + t.byte_offset, count * isz, code, count, device_type, t.device.device_id,
                       None, (obj, capsule))


def as_device_array(obj, stream=None, dtype=None):
    """The memory of a tensor, through ``__cuda_array_interface__`` (CuPy, Numba, PyTorch) or DLPack
    (JAX, numpy on the CPU, and the cases below).

    ``stream``: the consumer's stream. When given, and the interface names no producer stream (v2,
    as PyTorch exports, or ``stream: None``) while the object speaks DLPack, DLPack is used with
    ``__dlpack__(stream=stream)``, so that the producer orders its queued work before ours (PyTorch
    makes ``stream`` wait for its current stream on the calling thread). ``dtype``: the byteps dtype
    the caller knows the tensor has: it lets a raw typestr through (PyTorch bfloat16 is ``"<V2"``)
    and is checked against the typestr otherwise. A typestr nobody can name goes to DLPack when
    the object has it."""
    try:
        cai = obj.__cuda_array_interface__
    except (AttributeError, TypeError, RuntimeError):  # absent (CPU tensors), or not expressible: DLPack
        cai = None
    dlpack = hasattr(obj, "__dlpack__")
    if cai is not None:
        code = _cai_dtype(cai, dtype)
        unnamed = code is None
        no_stream = cai.get("stream") is None
        if not (dlpack and (unnamed or (stream is not None and no_stream))):
            return _from_cai(obj, cai, code)
    if dlpack:
        arr = _from_dlpack(obj, stream)
        if dtype is not None and arr.dtype != dtype:
            raise TypeError(f"DLPack says {dtypes.name(arr.dtype)}, but the tensor's dtype is {dtypes.name(dtype)}")
        return arr
    raise TypeError(f"{type(obj).__name__} exposes neither __cuda_array_interface__ nor __dlpack__")

