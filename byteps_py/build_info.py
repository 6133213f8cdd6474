"""Horovod's build queries, with their meaning for byteps: which of Horovod's controllers and GPU
libraries this build uses. byteps has no MPI, Gloo, DDL or oneCCL controller and needs none. It is
not compiled against CUDA or NCCL either: its native core loads the CUDA runtime and NCCL when first
used (the ones a CUDA build of PyTorch ships; core/gpu.py finds them), so :func:`cuda_built` and
:func:`nccl_built` answer for this process, as Horovod's do for its build. Re-exported by every framework plugin."""


def nccl_built():
    """NCCL's version as an integer (2.21.5 -> 22105), as Horovod returns it, when NCCL loads here (the NCCL
    stages among a machine's GPUs use it: core/pipeline/nccl_stages.h); 0 otherwise."""
    from byteps.core import gpu

    try:
        return gpu.nccl_version()
    except gpu.GpuError:
        return 0


def cuda_built():
    """Whether the CUDA runtime loads here, so that CUDA tensors take byteps's GPU path (Horovod: built
    with CUDA)."""
    from byteps.core import gpu

    try:
        gpu.cuda_device_count()
        return True
    except gpu.GpuError:
        return False


def _not_built():
    """byteps has no such controller or library."""
    return False


mpi_threads_supported = mpi_enabled = mpi_built = _not_built
gloo_enabled = gloo_built = ddl_built = ccl_built = rocm_built = _not_built
