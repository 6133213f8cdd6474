"""CUDA tensors through the native pipeline: what the engine submits for one, and where the CUDA runtime is.

A CUDA tensor's push_pull or broadcast is submitted as a :class:`DeviceBuffer`: the native core copies
each partition off the GPU into a page-locked staging slot (COPYD2H) after the ready event, runs the
host stages, and copies the result back (COPYH2D), per partition, so copies overlap the network
(core/pipeline/gpu_copier.h); the op's completion records the done event for the caller's stream to
wait on. Python never touches the partitions' bytes, and nothing CUDA is needed to build or import byteps.
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


def library_path(stem, configured=""):
    """The library the native core loads at the first CUDA tensor: lib``stem`` ("cudart" for the copy
    stages, "nccl" for the NCCL stages) from ``configured`` (BYTEPS_CUDART, BYTEPS_NCCL) if set, else
    PyTorch's wheels (found on sys.path without importing torch), else the system's; None if none."""
    found = library_candidates(stem, (), configured)
    return found[0] if found else None
