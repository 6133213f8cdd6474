# cython: language_level=3
# distutils: language = c++
"""Switch on and empty a native span buffer (core/pipeline/bps_trace.h) for the job timeline (byteps/timeline).

The buffer lives in the module whose threads record into it (``_worker_core`` or ``_server_core``),
which hands over its address (``trace_buffer()``); this module is the one place that reads it.
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uint64_t, uintptr_t
from libcpp.vector cimport vector

cdef extern from "core/pipeline/bps_trace.h" nogil:
    ctypedef struct BpsSpan:
        pass
    cdef cppclass BpsTrace:
        void enable(size_t capacity)
        uint64_t drain(vector[BpsSpan] *out)

#: bytes of one span (byteps_py/timeline/spans.py SPAN_DTYPE has the same layout)
SPAN_BYTES = sizeof(BpsSpan)


def enable(uintptr_t address, size_t capacity):
    """Record into the buffer at ``address``, holding at most ``capacity`` spans (0: stop recording)."""
    (<BpsTrace *>address).enable(capacity)


def drain(uintptr_t address):
    """(raw spans as bytes, spans dropped since the last drain) of the buffer at ``address``."""
    cdef vector[BpsSpan] spans
    cdef uint64_t dropped
    with nogil:
        dropped = (<BpsTrace *>address).drain(&spans)
    return PyBytes_FromStringAndSize(<char *>spans.data(), spans.size() * sizeof(BpsSpan)), dropped
