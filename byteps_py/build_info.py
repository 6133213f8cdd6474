"""Horovod's build queries, with their meaning for byteps: which of Horovod's controllers and GPU
libraries this build uses. byteps has no MPI, Gloo, DDL or oneCCL controller and needs none. It is
not compiled against CUDA or NCCL either: its native core loads the CUDA runtime and NCCL when first
used (the ones a CUDA build of PyTorch ships; core/gpu.py finds them), so :func:`cuda_built` and
:func:`nccl_built` answer for this process, as Horovod's do for its build. Re-exported by every framework plugin."""


def mpi_threads_supported():
    return False


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return False


def gloo_built():
    return False


def nccl_built():
    """NCCL's version as an integer (2.21.5 -> 22105), as Horovod returns it, when NCCL loads here (the NCCL
    stages among a machine's GPUs use it: core/pipeline/nccl_stages.h); 0 otherwise."""
    from byteps.core import gpu

    try:
        return gpu.nccl_version()
    except gpu.GpuError:
        return 0


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    """Whether the CUDA runtime loads here, so that CUDA tensors take byteps's GPU path (Horovod: built
    with CUDA)."""
    from byteps.core import gpu

    try:
        gpu.cuda_device_count()
        return True
    except gpu.GpuError:
        return False


def rocm_built():
    return False
