"""Horovod's build queries, with their meaning for byteps: which of Horovod's controllers and GPU
libraries this build uses. byteps has no MPI, Gloo, NCCL, DDL or oneCCL controller and needs none;
GPU tensors are staged through host memory. Re-exported by every framework plugin."""


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
    """0: byteps does not use NCCL (Horovod returns the NCCL version here)."""
    return 0


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    """False: byteps has no GPU kernels; CUDA tensors are staged through host memory."""
    return False


def rocm_built():
    return False
