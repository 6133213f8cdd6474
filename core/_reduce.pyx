"""Elementwise summation kernels for gradient aggregation (C code in bps_reduce.h).

Buffers are taken through the buffer protocol as raw bytes, so numpy arrays of any dtype, byte
views, bytearray, memoryview and zmq frames all work; the ``dtype`` code (byteps.core.dtypes) says
how to interpret them. The arithmetic runs without the GIL, in several threads for big buffers
(a pool of sleeping helpers in core/kernels/bps_pool.h; their number: :func:`default_threads`).

The ``codec_*`` functions are the wire compression codecs (C++ in bps_codecs.h), for
byteps.compression, which is their Python API and documents the format.
"""
import mmap
import os

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc

cnp.import_array()


cdef extern from "core/kernels/bps_reduce.h" nogil:
    size_t bps_par_min_bytes
    int bps_use_avx2, bps_use_f16c, bps_use_avx512, bps_has_avx512bf16
    void bps_cpu_init()
    void bps_set_simd_level(int level)
    int bps_itemsize(int dtype)
    const char *bps_dtype_name(int dtype)
    int bps_sum_into(void *dst, const void *src, size_t n, int dtype, int nthreads)
    int bps_sum_many(void *dst, const void *const *srcs, int nsrc, size_t n, int dtype, int nthreads)
    int bps_scale(void *buf, double factor, size_t n, int dtype, int nthreads)
    void bps_copy(void *dst, const void *src, size_t nbytes, int nthreads)
    void bps_copy_streamed(void *dst, const void *src, size_t nbytes, int nthreads)
    int bps_divide_copy(void *dst, const void *src, size_t n, int dtype, unsigned int divisor)


bps_cpu_init()

#: page size that aligned_empty() aligns to
PAGE = 4096

cdef int _nthreads = 1

#: one kernel thread per this many cores of this process's share of the machine: the training
#: thread, the engine's network thread and the server's keep a core each (see default_threads)
CORES_PER_THREAD = 4
#: never more kernel threads than this by default: memory bandwidth, not arithmetic, bounds a sum
MAX_DEFAULT_THREADS = 4


def _usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(env=None):
    """The kernels' thread count and why: ``(threads, reason)``.

    ``BYTEPS_OMP_THREAD_PER_GPU`` (as in BytePS) sets it. Otherwise the rule is
    ``clamp(cores // 4, 1, 4)``, where ``cores`` is this process's share of the machine: the CPUs it
    may run on, or ``OMP_NUM_THREADS`` when that is smaller (bpslaunch sets it to CPUs / local
    processes). A summing thread pays off only where it does not take the core that the training
    thread or the network threads need (docs/benchmarks.md, "Summation kernels"), and a sum is bound by
    memory bandwidth, which a few threads saturate.

    Raises:
        ConfigError: BYTEPS_OMP_THREAD_PER_GPU is not an integer in 1..64.
    """
    env = os.environ if env is None else env
    raw = (env.get("BYTEPS_OMP_THREAD_PER_GPU") or "").strip()
    if raw:
        try:
            value = int(raw, 10)
        except ValueError:
            value = None
        if value is None or not 1 <= value <= 64:
            from byteps.errors import ConfigError

            raise ConfigError(f"BYTEPS_OMP_THREAD_PER_GPU={raw!r} must be an integer from 1 to 64 "
                              "(threads of the summation kernels)")
        return value, "BYTEPS_OMP_THREAD_PER_GPU"
    cores = _usable_cpus()
    why = f"{cores} usable CPUs"
    omp = (env.get("OMP_NUM_THREADS") or "").strip()
    if omp.isdigit() and 0 < int(omp) < cores:
        cores = int(omp)
        why = f"OMP_NUM_THREADS={omp}"
    threads = max(1, min(MAX_DEFAULT_THREADS, cores // CORES_PER_THREAD))
    return threads, f"{why}: one thread per {CORES_PER_THREAD} cores, at most {MAX_DEFAULT_THREADS}"


_nthreads = default_threads()[0]


# ---------------------------------------------------------------------------------------------
# helpers

cdef inline Py_ssize_t _itemsize(int dtype) except -1:
    cdef int isz = bps_itemsize(dtype)
    if isz < 0:
        raise ValueError(f"unknown dtype code {dtype}; expected 0..7 (see byteps.core.dtypes)")
    return isz


cdef inline str _name(int dtype):
    return bps_dtype_name(dtype).decode()


cdef int _check_lengths(str what, Py_ssize_t dlen, Py_ssize_t slen, Py_ssize_t isz, int dtype) except -1:
    if dlen != slen or dlen % isz:
        raise ValueError(
            f"{what}: dst has {dlen} bytes and src has {slen} bytes; they must be equal and a "
            f"multiple of {isz} (the size of {_name(dtype)})")
    return 0


# ---------------------------------------------------------------------------------------------
# public API

def sum_into(dst, src, int dtype):
    """Add ``src`` into ``dst`` elementwise: ``dst[i] += src[i]``.

    Args:
        dst: writable C-contiguous buffer.
        src: C-contiguous buffer (may be read-only) with the same byte length as ``dst``;
            it must not partially overlap ``dst``.
        dtype: element type code from ``byteps.core.dtypes``. Integers wrap around; fp16 and
            bf16 are added in fp32 and rounded to nearest even.

    Raises:
        ValueError: unknown dtype, or byte lengths that differ or are not a multiple of the
            element size.
    """
    cdef Py_buffer d, s
    cdef Py_ssize_t isz = _itemsize(dtype)
    PyObject_GetBuffer(dst, &d, PyBUF_WRITABLE)
    try:
        PyObject_GetBuffer(src, &s, PyBUF_SIMPLE)
        try:
            _check_lengths("sum_into", d.len, s.len, isz, dtype)
            with nogil:
                bps_sum_into(d.buf, s.buf, <size_t>(d.len // isz), dtype, _nthreads)
        finally:
            PyBuffer_Release(&s)
    finally:
        PyBuffer_Release(&d)


def sum_many(dst, srcs, int dtype):
    """Write the sum of several buffers: ``dst = srcs[0] + srcs[1] + ...`` in one pass.

    fp16 and bf16 sources are accumulated in fp32 and rounded once at the end, which is both more
    accurate and faster than repeated :func:`sum_into`.

    Args:
        dst: writable C-contiguous buffer; may be the same buffer as ``srcs[0]``.
        srcs: non-empty sequence of C-contiguous buffers, each as long as ``dst`` in bytes.
        dtype: element type code from ``byteps.core.dtypes``.

    Raises:
        ValueError: unknown dtype, empty ``srcs``, or mismatched / non-multiple byte lengths.
    """
    cdef Py_ssize_t isz = _itemsize(dtype)
    srcs = tuple(srcs)
    cdef int nsrc = <int>len(srcs)
    if nsrc < 1:
        raise ValueError("sum_many: srcs must hold at least one buffer")
    cdef Py_buffer d
    cdef Py_buffer *views = <Py_buffer *>malloc(nsrc * sizeof(Py_buffer))
    cdef const void **ptrs = <const void **>malloc(nsrc * sizeof(void *))
    cdef int got = 0, k, rc
    if views == NULL or ptrs == NULL:
        free(views)
        free(ptrs)
        raise MemoryError()
    PyObject_GetBuffer(dst, &d, PyBUF_WRITABLE)
    try:
        for k in range(nsrc):
            PyObject_GetBuffer(srcs[k], &views[k], PyBUF_SIMPLE)
            got += 1
            _check_lengths(f"sum_many (srcs[{k}])", d.len, views[k].len, isz, dtype)
            ptrs[k] = views[k].buf
        with nogil:
            bps_sum_many(d.buf, ptrs, nsrc, <size_t>(d.len // isz), dtype, _nthreads)
    finally:
        for k in range(got):
            PyBuffer_Release(&views[k])
        PyBuffer_Release(&d)
        free(views)
        free(ptrs)


def copy_into(dst, src, bint stream=False):
    """Copy ``src`` into ``dst`` (same byte length), in parallel for big buffers.

    Args:
        dst: writable C-contiguous buffer.
        src: C-contiguous buffer with the same byte length; must not overlap ``dst``.
        stream: ``dst`` is not read again soon on this core (a result into the caller's tensor, a
            partition staged for another process): from 1 MB on, a copy on one thread writes it with
            non-temporal stores (bps_copy_streamed).

    Raises:
        ValueError: the byte lengths differ.
    """
    cdef Py_buffer d, s
    PyObject_GetBuffer(dst, &d, PyBUF_WRITABLE)
    try:
        PyObject_GetBuffer(src, &s, PyBUF_SIMPLE)
        try:
            if d.len != s.len:
                raise ValueError(f"copy_into: dst has {d.len} bytes and src has {s.len} bytes")
            with nogil:
                if stream:
                    bps_copy_streamed(d.buf, s.buf, <size_t>d.len, _nthreads)
                else:
                    bps_copy(d.buf, s.buf, <size_t>d.len, _nthreads)
        finally:
            PyBuffer_Release(&s)
    finally:
        PyBuffer_Release(&d)


def scale(buf, double factor, int dtype):
    """Multiply a float buffer in place: ``buf[i] *= factor`` (used for averaging).

    fp32, fp16 and bf16 multiply in fp32 by ``float32(factor)``; fp64 in fp64.

    Args:
        buf: writable C-contiguous buffer.
        factor: the multiplier.
        dtype: a floating dtype code from ``byteps.core.dtypes``.

    Raises:
        ValueError: unknown or integer dtype (average integers with floor division instead),
            or a byte length that is not a multiple of the element size.
    """
    _in_place("scale", buf, dtype, factor, 0)


def divide(buf, unsigned int divisor, int dtype):
    """Divide a float buffer in place: ``buf[i] /= divisor``, an average, bit for bit as torch's
    ``div_`` computes it (a true division; fp16 and bf16 in fp32, rounded once). The native core
    folds the same division into its result copy (bps_divide_copy); this is the pass for results
    that came another way (the Python engine: compression, process sets).

    Raises:
        ValueError: a divisor of 0, an unknown or integer dtype, or a byte length that is not a
            multiple of the element size.
    """
    if divisor == 0:
        raise ValueError("divide: divisor 0 (an average over no workers)")
    _in_place("divide", buf, dtype, 1.0, divisor)


cdef _in_place(str what, buf, int dtype, double factor, unsigned int divisor):
    """:func:`scale` (``divisor`` 0) or :func:`divide` a float buffer in place, with the checks both make."""
    cdef Py_buffer b
    cdef Py_ssize_t isz = _itemsize(dtype)
    cdef int rc
    PyObject_GetBuffer(buf, &b, PyBUF_WRITABLE)
    try:
        if b.len % isz:
            raise ValueError(f"{what}: buffer has {b.len} bytes, not a multiple of {isz} "
                             f"(the size of {_name(dtype)})")
        with nogil:
            if divisor:
                rc = bps_divide_copy(b.buf, b.buf, <size_t>(b.len // isz), dtype, divisor)
            else:
                rc = bps_scale(b.buf, factor, <size_t>(b.len // isz), dtype, _nthreads)
        if rc != 0:
            raise ValueError(f"{what}: {_name(dtype)} is not a floating dtype; "
                             "integer averaging uses floor division")
    finally:
        PyBuffer_Release(&b)


#: from this size up, aligned_empty() maps its own memory and asks for transparent huge pages
HUGEPAGE_BYTES = 2 << 20


def aligned_empty(Py_ssize_t nbytes):
    """Allocate an uninitialised, page-aligned (4096) uint8 array.

    From 2 MB up (servers' stores, fusion buffers) the array is its own private anonymous mapping
    with MADV_HUGEPAGE: where the kernel has transparent huge pages in ``madvise`` mode, its first
    write takes one fault per 2 MB instead of one per 4 KB. The mapping is freed with the array.

    Args:
        nbytes: size in bytes (>= 0).

    Returns:
        numpy.ndarray: a 1-D uint8 view of ``nbytes`` whose data pointer is a multiple of 4096;
        it keeps its over-allocated base array (or its mapping) alive.
    """
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes}")
    if nbytes >= HUGEPAGE_BYTES:
        m = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP unsupported here: 4 KB pages
                pass
        return np.frombuffer(m, dtype=np.uint8)
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off:off + nbytes + 1][:nbytes]  # an empty slice would keep raw's unaligned pointer


def set_num_threads(int n):
    """Set the threads (the caller's included) used for buffers above the parallel threshold.

    Args:
        n: thread count (>= 1).
    """
    global _nthreads
    if n < 1:
        raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
    _nthreads = n


def get_num_threads():
    """Return the thread count used for big buffers (the caller's thread included).

    Returns:
        int: the current thread count.
    """
    return _nthreads


def cpu_features():
    """Report which SIMD code paths the kernels use on this CPU.

    Returns:
        dict: ``avx2`` (fp32/fp64/int loops, bf16 conversions), ``f16c`` (fp16 conversions),
        ``avx512`` (avx512f+bw: 512-bit loops for every dtype) and ``avx512bf16`` (always False: VCVTNEPS2BF16
        flushes subnormals, so exact rounding is done with integer ops instead).
    """
    return {"avx2": bool(bps_use_avx2), "f16c": bool(bps_use_f16c),
            "avx512": bool(bps_use_avx512), "avx512bf16": False}


def _set_simd_level(int level):
    """Testing aid: 0 = portable scalar code, 1 = up to AVX2/F16C, 2 = all available."""
    bps_set_simd_level(level)


def _set_parallel_threshold(Py_ssize_t nbytes):
    """Testing/benchmark aid: buffers of at least ``nbytes`` use several threads."""
    global bps_par_min_bytes
    bps_par_min_bytes = <size_t>max(nbytes, 0)


def _get_parallel_threshold():
    return bps_par_min_bytes


def byte_array(uintptr_t address, Py_ssize_t nbytes, owner):
    """A flat, writable uint8 numpy array over ``nbytes`` bytes at ``address`` that keeps ``owner``
    (the object owning that memory, e.g. a torch tensor) alive. One C call: building the same view
    through a framework's own reshape/view/numpy costs several microseconds per push_pull."""
    if nbytes <= 0 or address == 0:
        return np.empty(0, dtype=np.uint8)
    cdef cnp.npy_intp n = nbytes
    arr = cnp.PyArray_SimpleNewFromData(1, &n, cnp.NPY_UINT8, <void *>address)
    cnp.set_array_base(arr, owner)
    return arr


# ---------------------------------------------------------------------------------------------
# wire compression codecs (core/kernels/bps_codecs.h; the Python API is byteps.compression)

cdef extern from "core/kernels/bps_codecs.h" nogil:
    enum: BPS_CZ_HEADER
    enum: BPS_CZ_ERRLEN
    enum: BPS_CZ_F_EF
    ctypedef struct BpsCodecInfo:
        int method, dtype, flags, levels
        uint64_t n, k, seed
        const uint8_t *payload
    ctypedef struct BpsCodecParams:
        int method, dtype, flags, levels
        uint64_t k, seed, dither_seed
    int bps_cz_parse(const uint8_t *buf, size_t len, BpsCodecInfo *info, char *err)
    size_t bps_cz_encoded_size(const BpsCodecParams &p, uint64_t n)
    unsigned long long bps_cz_payload_size(int method, uint64_t n, int itemsize, uint64_t k, int levels)
    uint64_t bps_cz_k_for(double k, uint64_t n)
    uint64_t bps_cz_derive_seed(uint64_t seed, uint64_t key, uint64_t rnd, int has_stream, uint32_t stream)
    void bps_cz_random_indices(uint64_t seed64, uint64_t n, uint64_t k, uint32_t *out)
    size_t bps_cz_compress(const BpsCodecParams *p, const void *input, uint64_t n, void *momentum, double mu,
                           int nesterov, void *residual, int residual_valid, void *work, uint8_t *out)
    int bps_cz_decode(const BpsCodecInfo *info, void *out, int accumulate, char *err)
    BpsCodecParams bps_cz_reply(const BpsCodecInfo *push, const void *total, uint64_t n, uint64_t key,
                                uint64_t rnd, uint32_t stream)

_CODEC_DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64)}


cdef _codec_error(const char *err):
    from byteps.errors import CodecError

    return CodecError(err.decode())


cdef int _parse_blob(Py_buffer *b, BpsCodecInfo *info) except -1:
    cdef char err[BPS_CZ_ERRLEN]
    if bps_cz_parse(<const uint8_t *>b.buf, <size_t>b.len, info, err):
        raise _codec_error(err)
    return 0


cdef int _parse_object(blob, BpsCodecInfo *info) except -1:
    """Header fields of a blob given as any buffer (the payload pointer is not kept valid)."""
    cdef Py_buffer b
    PyObject_GetBuffer(blob, &b, PyBUF_SIMPLE)
    try:
        _parse_blob(&b, info)
    finally:
        PyBuffer_Release(&b)
    return 0


cdef Py_ssize_t _typed_len(str what, Py_buffer *b, int dtype) except -1:
    """Elements of ``dtype`` (0 float32, 1 float64) in buffer b, or ValueError."""
    if dtype not in _CODEC_DTYPES:
        raise ValueError(f"{what}: compressed values are float32 (0) or float64 (1), not dtype code {dtype}")
    cdef Py_ssize_t isz = 8 if dtype else 4
    if b.len % isz:
        raise ValueError(f"{what}: {b.len} bytes are not a whole number of {_CODEC_DTYPES[dtype].name}")
    return b.len // isz


def codec_parse(blob):
    """Validate a compressed blob; its header fields ``(method, dtype, flags, levels, n, k, seed)``.

    Raises:
        byteps.errors.CodecError: anything malformed (the text names what).
    """
    cdef BpsCodecInfo info
    _parse_object(blob, &info)
    return info.method, info.dtype, info.flags, info.levels, info.n, info.k, info.seed


def codec_decode_into(blob, out, bint accumulate=False):
    """Write (accumulate: add) the values of ``blob`` into the writable buffer ``out``, which must
    hold exactly the blob's n values of its dtype.

    Raises:
        byteps.errors.CodecError: a malformed blob, or an ``out`` of another size.
    """
    cdef Py_buffer b, o
    cdef BpsCodecInfo info
    cdef char err[BPS_CZ_ERRLEN]
    cdef int rc
    PyObject_GetBuffer(blob, &b, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(out, &o, PyBUF_WRITABLE)
        try:
            _parse_blob(&b, &info)
            isz = 8 if info.dtype else 4
            if <uint64_t>o.len != info.n * isz:
                from byteps.errors import CodecError

                raise CodecError(f"{('fp16', 'bf16', 'onebit', 'topk', 'randomk', 'dithering', 'sparse')[info.method - 1]}"
                                 f" body decodes to {info.n} {_CODEC_DTYPES[info.dtype].name} values, the destination"
                                 f" holds {o.len} bytes")
            with nogil:
                rc = bps_cz_decode(&info, o.buf, accumulate, err)
            if rc:
                raise _codec_error(err)
        finally:
            PyBuffer_Release(&o)
    finally:
        PyBuffer_Release(&b)
    return out


def codec_compress(int method, int dtype, int flags, int levels, uint64_t k, uint64_t seed, uint64_t dither_seed,
                   values, momentum=None, double mu=0.0, bint nesterov=False, residual=None,
                   bint residual_valid=False):
    """The blob (bytes) of ``values`` (a buffer of float32/float64 by ``dtype``) encoded by ``method``.

    ``momentum`` (writable, same size): momentum correction, updated in place (``m = mu m + g``;
    sent: ``m``, or ``g + mu m`` with ``nesterov``). ``residual`` (writable, same size): error
    feedback, added to what is sent when ``residual_valid`` and then set to what the encoding lost.
    """
    cdef Py_buffer v, m, r
    cdef BpsCodecParams p
    cdef void *mptr = NULL
    cdef void *rptr = NULL
    cdef void *wptr = NULL
    cdef uint8_t *optr
    cdef Py_ssize_t n
    cdef size_t written
    p.method, p.dtype, p.flags, p.levels, p.k, p.seed, p.dither_seed = method, dtype, flags, levels, k, seed, dither_seed
    if not 1 <= method <= 7:
        raise ValueError(f"codec_compress: unknown compression method {method}")
    if method == 6 and not 1 <= levels <= 0x7FFF:
        raise ValueError(f"codec_compress: dithering levels must be in 1..32767, got {levels}")
    PyObject_GetBuffer(values, &v, PyBUF_SIMPLE)
    try:
        n = _typed_len("codec_compress", &v, dtype)
        if method in (4, 5) and not 1 <= k <= <uint64_t>n:  # topk, randomk
            raise ValueError(f"codec_compress: k={k} of n={n} elements")
        if momentum is not None:
            PyObject_GetBuffer(momentum, &m, PyBUF_WRITABLE)
            mptr = m.buf
            if m.len != v.len:
                raise ValueError(f"codec_compress: momentum has {m.len} bytes, the values {v.len}")
        if residual is not None:
            PyObject_GetBuffer(residual, &r, PyBUF_WRITABLE)
            rptr = r.buf
            if r.len != v.len:
                raise ValueError(f"codec_compress: residual has {r.len} bytes, the values {v.len}")
        work = aligned_empty(v.len) if (mptr != NULL or (rptr != NULL and residual_valid)) else None
        if work is not None:
            wptr = <void *><uintptr_t>work.ctypes.data
        blob = PyBytes_FromStringAndSize(NULL, bps_cz_encoded_size(p, n))
        optr = <uint8_t *>PyBytes_AS_STRING(blob)
        with nogil:
            written = bps_cz_compress(&p, v.buf, n, mptr, mu, nesterov, rptr, residual_valid, wptr, optr)
        if written != <size_t>len(blob):
            raise ValueError(f"codec_compress: a sparse encoding of k={k} values, but they hold another count of "
                             "non-zeros")
        return blob
    finally:
        PyBuffer_Release(&v)
        if mptr != NULL:
            PyBuffer_Release(&m)
        if rptr != NULL:
            PyBuffer_Release(&r)


def codec_recompress(push, total, uint64_t key, uint64_t rnd, uint32_t stream, residual=None,
                     bint residual_valid=False):
    """A server's reply blob to pushes compressed like ``push`` (any of them: a blob) for the sum
    ``total`` (a buffer of the push's dtype), or None where the raw sum is to be sent (top-k's
    sparse sum would not be smaller). ``residual``: the server's error feedback, used only where
    the reply keeps error feedback (fp16, bf16, onebit, dithering with F_EF)."""
    cdef Py_buffer t
    cdef BpsCodecInfo info
    cdef BpsCodecParams p
    cdef Py_ssize_t n
    _parse_object(push, &info)
    PyObject_GetBuffer(total, &t, PyBUF_SIMPLE)
    try:
        n = _typed_len("codec_recompress", &t, info.dtype)
        if <uint64_t>n != info.n:
            raise ValueError(f"codec_recompress: the sum holds {n} values, the pushes {info.n}")
        with nogil:
            p = bps_cz_reply(&info, t.buf, n, key, rnd, stream)
        if p.method == 0:
            return None
        if not p.flags & BPS_CZ_F_EF:
            residual = None
        return codec_compress(p.method, p.dtype, p.flags, p.levels, p.k, p.seed, p.dither_seed, total,
                              residual=residual, residual_valid=residual_valid)
    finally:
        PyBuffer_Release(&t)


def codec_payload_size(int method, uint64_t n, int itemsize, uint64_t k=0, int levels=0):
    """Exact payload bytes of a blob (the header excluded)."""
    return int(bps_cz_payload_size(method, n, itemsize, k, levels))


def codec_k_for(double k, uint64_t n):
    """BytePS's compressor_k: below 1 a fraction of n (rounded up), from 1 a count; within 1..n."""
    return bps_cz_k_for(k, n)


def codec_derive_seed(uint64_t seed, uint64_t key, uint64_t rnd, stream=None):
    """64-bit seed of one message's random stream, from (seed, wire key, round[, stream])."""
    return bps_cz_derive_seed(seed, key, rnd, stream is not None, <uint32_t>(stream or 0))


def codec_random_indices(uint64_t seed64, uint64_t n, uint64_t k):
    """k distinct indices in [0, n), increasing (uint32), drawn from PCG64(seed64)."""
    out = np.empty(min(k, n), dtype=np.uint32)
    cdef uint32_t[::1] view = out
    if out.size:
        with nogil:
            bps_cz_random_indices(seed64, n, k, &view[0])
    return out
