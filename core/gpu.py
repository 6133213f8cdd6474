"""Where the CUDA runtime and NCCL are, and whether they work here.

byteps is not compiled against CUDA, NCCL or any framework: the native core dlopens ``libcudart``
(the copy stages) and ``libnccl`` (the NCCL stages) at the first CUDA tensor, from the places
:func:`library_candidates` lists, so that a process holds one CUDA runtime. Through ctypes, this
module also answers Horovod's build queries (byteps/build_info.py) and why a GPU test skips
(:func:`unavailable_reason`); ``import byteps.core.gpu`` works on any machine.
"""
import ctypes
import ctypes.util
import glob
import os
import sys
import threading

from byteps.errors import BytePSError


class GpuError(BytePSError):
    """The CUDA runtime or NCCL is missing here, or a query of it failed."""


def wheel_libraries(stem):
    """lib<stem>.so* of the nvidia-* wheels PyTorch installs (nvidia/cuda_runtime/lib, nvidia/nccl/lib, ...
    on sys.path), newest name first per folder."""
    dirs = [d for entry in sys.path for d in glob.glob(os.path.join(entry, "nvidia", "*", "lib"))]
    return [path for d in dirs for path in sorted(glob.glob(os.path.join(d, f"lib{stem}.so*")), reverse=True)]


def library_candidates(stem, sonames=(), configured=""):
    """Where lib<stem> is looked for, in order: ``configured`` (BYTEPS_CUDART / BYTEPS_NCCL), PyTorch's
    nvidia-* wheels (the libraries torch itself loads), the system's (``ctypes.util.find_library``), then
    bare ``sonames``. The native core takes the first of them, so that a process holds one CUDA runtime."""
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
            return ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name} ({e})" if os.sep in name else name)
    raise GpuError(f"lib{stem} not found (tried {', '.join(tried) or 'nothing'}); install the CUDA runtime / "
                   f"NCCL, or a CUDA build of PyTorch that ships them")


_LOCK = threading.Lock()
_LIBS = {}


def _library(stem, sonames, variable):
    with _LOCK:
        if stem not in _LIBS:
            _LIBS[stem] = _open(stem, sonames, os.environ.get(variable, "").strip())
        return _LIBS[stem]


def cuda_device_count():
    """CUDA devices here (0 with none); GpuError if the runtime is missing or the query fails."""
    lib = _library("cudart", ["libcudart.so", "libcudart.so.12", "libcudart.so.11.0"], "BYTEPS_CUDART")
    n = ctypes.c_int(0)
    rc = lib.cudaGetDeviceCount(ctypes.byref(n))
    if rc != 0:
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        raise GpuError(f"cudaGetDeviceCount failed: {lib.cudaGetErrorString(rc).decode()} ({rc})")
    return n.value


def nccl_version():
    """NCCL's version as an integer (2.21.5 -> 22105); GpuError if NCCL is missing."""
    lib = _library("nccl", ["libnccl.so", "libnccl.so.2"], "BYTEPS_NCCL")
    v = ctypes.c_int(0)
    if lib.ncclGetVersion(ctypes.byref(v)) != 0:
        raise GpuError("ncclGetVersion failed")
    return v.value


def unavailable_reason(need_nccl=True, min_devices=1):
    """None when CUDA (and NCCL) work with at least ``min_devices`` GPUs, else why not ("no CUDA
    device: ..."), the text GPU tests skip with."""
    try:
        count = cuda_device_count()
    except GpuError as e:
        return f"no CUDA device: {e}"
    if count < min_devices:
        return "no CUDA device: cudaGetDeviceCount found 0 devices" if count == 0 else \
            f"needs {min_devices} CUDA devices, found {count}"
    if need_nccl:
        try:
            nccl_version()
        except GpuError as e:
            return f"no NCCL: {e}"
    return None
