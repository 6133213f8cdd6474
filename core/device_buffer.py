"""CUDA tensors through the native pipeline: what the engine submits for one, and where the CUDA runtime is.

A CUDA tensor's push_pull or broadcast is submitted as a :class:`DeviceBuffer` (its device address, size,
device, the producer's ready event and a done event, all as CUDA handles): the native core copies each
partition off the GPU into a page-locked staging slot (COPYD2H) after the ready event, runs the host
stages, and copies the result back (COPYH2D), per partition, so copies overlap the network
(core/pipeline/gpu_copier.h). The op's completion records the done event on byteps' stream, for the
caller's stream to wait on (no host block). Python never touches the partitions' bytes.

The CUDA runtime is loaded by the native core at the first CUDA tensor (:func:`cudart_path`):
``BYTEPS_CUDART``, else the libcudart of PyTorch's CUDA wheels (``nvidia/cuda_runtime/lib``), else the
system's; NCCL likewise (:func:`nccl_path`, ``BYTEPS_NCCL``) where CUDA push_pulls take the NCCL stages
(core/pipeline/nccl_stages.h); nothing CUDA is needed to build or import byteps.
"""

from .gpu import library_candidates


class DeviceBuffer:
    """A CUDA tensor's memory as the engine submits it (``Op.buf`` of a CUDA tensor).

    Args:
        ptr: its device address. nbytes: its size. device: its device ordinal.
        ready_event: a cudaEvent_t recorded on the producer's stream after the tensor was written
            (0: none); the first copy waits for it on the device (cudaStreamWaitEvent).
        done_event: a cudaEvent_t the native core records after the op's last copy (0: none).
        keep: objects to keep alive while the op runs (the tensor, the events' owners).
    """

    __slots__ = ("ptr", "nbytes", "device", "ready_event", "done_event", "keep")

    def __init__(self, ptr, nbytes, device, ready_event=0, done_event=0, keep=()):
        self.ptr, self.nbytes, self.device = int(ptr), int(nbytes), int(device)
        self.ready_event, self.done_event, self.keep = int(ready_event), int(done_event), keep


def cudart_path(configured=""):
    """The CUDA runtime library the native core loads: ``configured`` (BYTEPS_CUDART) if set, else
    PyTorch's wheel's libcudart (found on sys.path without importing torch), else the system's; None
    when there is none (CUDA tensors then fail naming why)."""
    found = library_candidates("cudart", (), configured)
    return found[0] if found else None


def nccl_path(configured=""):
    """The NCCL library the NCCL stages load: ``configured`` (BYTEPS_NCCL) if set, else PyTorch's wheel's
    libnccl, else the system's; None when there is none."""
    found = library_candidates("nccl", (), configured)
    return found[0] if found else None


def staging_slots(budget_bytes, slot_bytes):
    """Slots of the staging ring within ``budget_bytes`` (BYTEPS_GPU_STAGING_BYTES): at least 2, so
    that one partition's copy overlaps another's round trip."""
    return max(2, budget_bytes // max(1, slot_bytes))
