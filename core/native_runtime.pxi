# The Python face of native_runtime.pxd, included by core/_worker_core.pyx and summation/_server_core.pyx.
# Each extension holds its own copy of these static functions (its own libzmq and libucp handles, SIMD
# dispatch and span buffer), so each module defines these names over its own copy.
from libc.stdint cimport uintptr_t

from byteps.core import transport as _transport

from byteps.core.native_runtime cimport (bps_cpu_init, bps_ucx_buffers_mapped, bps_ucx_built, bps_ucx_load,
                                        bps_ucx_registered_transfers, bps_ucx_version, bps_ucx_why, bps_zmq_load)

cdef extern from "core/pipeline/bps_trace.h" nogil:
    uintptr_t bps_trace_address()

#: True when the native core can run here (it needs the libzmq that pyzmq loaded)
available = _transport.LIBZMQ is not None and bps_zmq_load(_transport.LIBZMQ.encode()) == 0
#: why not, when it cannot
unavailable_reason = "" if available else (_transport.LIBZMQ_MISSING or
                                           f"{_transport.LIBZMQ}: libzmq's functions were not found")

#: True when this build has the UCX transport (UCX headers were found at build time: setup.py)
ucx_built = bps_ucx_built()


def ucx_load(str path):
    """Resolve libucp's calls from ``path`` (core/ucx.py chose it): (True, version) or (False, why)."""
    if bps_ucx_load(path.encode()) == 0:
        return True, bps_ucx_version().decode()
    return False, bps_ucx_why().decode("utf-8", "replace")


def ucx_registrations():
    """(pooled buffers this process registered with ucp_mem_map, transfers that passed such a
    registration to UCX): a buffer is mapped once and its registration used on every later step."""
    return bps_ucx_buffers_mapped(), bps_ucx_registered_transfers()


def trace_buffer():
    """Address of this process's native span buffer (core/pipeline/bps_trace.h), for core/_trace.pyx."""
    return bps_trace_address()


bps_cpu_init()  # this module's copy of the kernels (core/kernels/bps_reduce.h) picks its SIMD level
