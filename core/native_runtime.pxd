# The run-time pieces every native core carries its own copy of (static functions of these headers):
# each extension resolves libzmq and libucp itself and picks its own SIMD kernels. Declared once here
# for _worker_core.pyx and summation/_server_core.pyx.
from libc.stdint cimport uint64_t
from libcpp cimport bool as cbool
from libcpp.string cimport string

cdef extern from "core/transport/bps_zmq.h" nogil:
    int bps_zmq_load(const char *path)

cdef extern from "core/transport/bps_ucx.h" nogil:
    int bps_ucx_load(const char *path)
    cbool bps_ucx_built()
    string bps_ucx_why()
    string bps_ucx_version()
    uint64_t bps_ucx_buffers_mapped()
    uint64_t bps_ucx_registered_transfers()

cdef extern from "core/kernels/bps_reduce.h" nogil:
    void bps_cpu_init()
