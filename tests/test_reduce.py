"""Tests for the summation kernels in byteps.core._reduce against numpy / torch ground truth."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from byteps.core import _reduce, dtypes

LENGTHS = [0, 1, 7, 15, 17, 31, 33, 1000003]
NATIVE = ["float32", "float64", "int32", "int64", "uint8", "int8"]


@pytest.fixture(params=[0, 1, 2], ids=["scalar", "avx2", "avx512"])
def simd(request):
    """Run a test on each code path (levels the CPU lacks fall back to the next lower one)."""
    _reduce._set_simd_level(request.param)
    yield request.param
    _reduce._set_simd_level(2)


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def rand_bits(rng, n):
    """Every 16-bit pattern is fair game: subnormals, huge values, Inf and NaN included."""
    return rng.integers(0, 1 << 16, n, dtype=np.uint16)


def rand_native(rng, name, n):
    if name.startswith(("int", "uint")):
        info = np.iinfo(name)
        return rng.integers(info.min, info.max, n, dtype=name, endpoint=True)
    return (rng.standard_normal(n) * 1e3).astype(name)


def f16_sum_truth(*arrays):
    """numpy's fp16 add: widen to fp32, add in order, round once."""
    acc = arrays[0].view(np.float16).astype(np.float32)
    for a in arrays[1:]:
        acc = acc + a.view(np.float16).astype(np.float32)
    return acc.astype(np.float16).view(np.uint16)


def is_f16_nan(bits):
    return (bits & 0x7FFF) > 0x7C00


def assert_f16_equal(got, want, *inputs):
    """Bit-exact. Where two or more inputs are NaN, numpy's choice of payload depends on its loop
    (operand order), so there only require a quiet NaN taken from one of the inputs."""
    several_nan = np.sum([is_f16_nan(x) for x in inputs], axis=0) >= 2 if inputs else np.zeros(len(got), bool)
    np.testing.assert_array_equal(got[~several_nan], want[~several_nan])
    nan_out = got[several_nan]
    assert np.all(is_f16_nan(nan_out)) and np.all(nan_out & 0x0200)
    candidates = np.stack([x[several_nan] | 0x0200 for x in inputs])
    assert np.all((candidates == nan_out).any(axis=0))


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_round_truth(torch, f32):
    """torch's fp32 -> bf16 conversion (round to nearest even), as uint16 bits."""
    return torch.from_numpy(np.ascontiguousarray(f32)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def is_bf16_nan(bits):
    return (bits & 0x7FFF) > 0x7F80


def assert_bf16_equal(got, want, quiet=True):
    """Bit-exact, except that NaN payloads may differ (torch canonicalises NaN); sums are quiet."""
    got_nan, want_nan = is_bf16_nan(got), is_bf16_nan(want)
    np.testing.assert_array_equal(got_nan, want_nan)
    np.testing.assert_array_equal(got[~got_nan], want[~want_nan])
    assert not quiet or np.all(got[got_nan] & 0x0040), "NaN results of arithmetic must be quiet"


# ---------------------------------------------------------------------------------------------
# sum_into


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("name", NATIVE)
def test_sum_into_native_exact(simd, name, n):
    rng = np.random.default_rng(n)
    a, b = rand_native(rng, name, n), rand_native(rng, name, n)
    with np.errstate(over="ignore"):
        want = a + b  # integer wrap-around, exactly rounded float add
    _reduce.sum_into(a, b, dtypes.from_name(name))
    np.testing.assert_array_equal(a, want)


@pytest.mark.parametrize("name", ["float32", "float64"])
def test_sum_into_float_specials(simd, name):
    vals = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, np.finfo(name).max,
                     np.finfo(name).tiny, np.finfo(name).smallest_subnormal], dtype=name)
    a, b = np.repeat(vals, len(vals)), np.tile(vals, len(vals))
    with np.errstate(all="ignore"):
        want = a + b
    _reduce.sum_into(a, b, dtypes.from_name(name))
    np.testing.assert_array_equal(a, want)  # NaN positions must match too
    assert np.array_equal(np.signbit(a[want == 0]), np.signbit(want[want == 0]))


@pytest.mark.parametrize("n", LENGTHS)
def test_sum_into_fp16_bit_exact(simd, n):
    rng = np.random.default_rng(100 + n)
    a, b = rand_bits(rng, n), rand_bits(rng, n)
    with np.errstate(all="ignore"):
        want = f16_sum_truth(a, b)
    got = a.copy()
    _reduce.sum_into(got, b, dtypes.FLOAT16)
    assert_f16_equal(got, want, a, b)


def test_sum_into_fp16_specials(simd):
    vals = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 65488.0, 32768.0, 6.1035156e-05,
                     5.9604645e-08, -5.9604645e-08, 6.0975552e-05, 0.33325195, np.inf, -np.inf, np.nan],
                    dtype=np.float16).view(np.uint16)
    vals = np.concatenate([vals, np.array([0x7C01, 0xFE00, 0x7E55], np.uint16)])  # sNaN, NaN payloads
    a, b = np.repeat(vals, len(vals)), np.tile(vals, len(vals))
    with np.errstate(all="ignore"):
        want = f16_sum_truth(a, b)
    got = a.copy()
    _reduce.sum_into(got, b, dtypes.FLOAT16)
    assert_f16_equal(got, want, a, b)
    assert got[(a == vals[4]) & (b == vals[6])][0] == 0x7C00  # 65504 + 65488 overflows to +Inf
    assert got[(a == vals[1]) & (b == vals[1])][0] == 0x8000  # -0 + -0 == -0


@pytest.mark.parametrize("n", LENGTHS)
def test_sum_into_bf16_matches_torch(simd, torch, n):
    rng = np.random.default_rng(200 + n)
    a, b = rand_bits(rng, n), rand_bits(rng, n)
    with np.errstate(all="ignore"):
        want = bf16_round_truth(torch, bf16_to_f32(a) + bf16_to_f32(b))
    _reduce.sum_into(a, b, dtypes.BFLOAT16)
    assert_bf16_equal(a, want)


def test_sum_into_bf16_specials(simd, torch):
    vals = np.array([0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x0001, 0x8001, 0x007F, 0x0080,
                     0x3F81, 0x4040, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFFFF], np.uint16)
    a, b = np.repeat(vals, len(vals)), np.tile(vals, len(vals))
    with np.errstate(all="ignore"):
        want = bf16_round_truth(torch, bf16_to_f32(a) + bf16_to_f32(b))
    got = a.copy()
    _reduce.sum_into(got, b, dtypes.BFLOAT16)
    assert_bf16_equal(got, want)
    # NaN with a tiny or all-ones payload must stay NaN (a careless rounding carry makes Inf / -0)
    for nan in (0x7F81, 0x7FFF, 0xFFFF):
        x = np.array([nan] * 9, np.uint16)
        _reduce.sum_into(x, np.full(9, 0x3F80, np.uint16), dtypes.BFLOAT16)
        assert is_bf16_nan(x).all()
    # largest finite + largest finite overflows to Inf
    x = np.full(9, 0x7F7F, np.uint16)
    _reduce.sum_into(x, x.copy(), dtypes.BFLOAT16)
    assert (x == 0x7F80).all()


@pytest.mark.parametrize("n", [15, 16, 17, 31, 32, 33, 100, 1000])
def test_sum_into_unaligned_buffers(simd, torch, n):
    """Every 2-byte offset within a cache line: the wide paths peel to an aligned dst."""
    rng = np.random.default_rng(n)
    raw = rng.integers(0, 1 << 16, (3, n + 40), dtype=np.uint16)
    for off in range(32):
        a, b = raw[0, off:off + n], raw[1, 7:7 + n]
        with np.errstate(all="ignore"):
            want16 = f16_sum_truth(a, b)
            want_bf = bf16_round_truth(torch, bf16_to_f32(a) + bf16_to_f32(b))
        got = raw[2, off:off + n]
        got[:] = a
        _reduce.sum_into(got, b, dtypes.FLOAT16)
        assert_f16_equal(got, want16, a, b)
        got[:] = a
        _reduce.sum_into(got, b, dtypes.BFLOAT16)
        assert_bf16_equal(got, want_bf)


def test_sum_into_readonly_sources(simd):
    a = np.arange(33, dtype=np.float32)
    src = np.ones(33, np.float32).tobytes()
    _reduce.sum_into(a, src, dtypes.FLOAT32)
    _reduce.sum_into(a, memoryview(src), dtypes.FLOAT32)
    ro = np.ones(33, np.float32)
    ro.flags.writeable = False
    _reduce.sum_into(a, ro, dtypes.FLOAT32)
    np.testing.assert_array_equal(a, np.arange(33, dtype=np.float32) + 3)


def test_sum_into_accepts_byte_views_and_bytearray():
    a = np.arange(17, dtype=np.int32)
    b = bytearray(np.full(17, 5, np.int32).tobytes())
    _reduce.sum_into(a.view(np.uint8), b, dtypes.INT32)
    _reduce.sum_into(memoryview(a).cast("B"), b, dtypes.INT32)
    np.testing.assert_array_equal(a, np.arange(17) + 10)
    out = bytearray(8)
    _reduce.sum_into(out, np.array([1.5, 2.5], np.float32), dtypes.FLOAT32)
    np.testing.assert_array_equal(np.frombuffer(out, np.float32), [1.5, 2.5])


def test_sum_into_errors():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"16 bytes.*12 bytes.*float32"):
        _reduce.sum_into(a, np.zeros(3, np.float32), dtypes.FLOAT32)
    with pytest.raises(ValueError, match=r"6 bytes.*6 bytes.*multiple of 4.*float32"):
        _reduce.sum_into(bytearray(6), bytes(6), dtypes.FLOAT32)
    with pytest.raises(ValueError, match="bfloat16"):
        _reduce.sum_into(bytearray(3), bytes(3), dtypes.BFLOAT16)
    for bad in (8, -1, 99):
        with pytest.raises(ValueError, match="dtype"):
            _reduce.sum_into(a, a.copy(), bad)
    with pytest.raises((BufferError, TypeError)):  # read-only destination
        _reduce.sum_into(bytes(16), a, dtypes.FLOAT32)
    with pytest.raises((BufferError, ValueError)):  # not contiguous
        _reduce.sum_into(np.zeros(8, np.float32)[::2], a, dtypes.FLOAT32)


def test_dtype_names_match_dtypes_module():
    for code, (name, size) in dtypes.INFO.items():
        with pytest.raises(ValueError, match=rf"multiple of {size} \(the size of {name}\)"):
            _reduce.sum_into(bytearray(size), bytes(2 * size), code)


# ---------------------------------------------------------------------------------------------
# sum_many


@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 33, 1000003])
@pytest.mark.parametrize("name", NATIVE)
def test_sum_many_native(name, nsrc, n):
    rng = np.random.default_rng(nsrc * 7 + n)
    srcs = [rand_native(rng, name, n) for _ in range(nsrc)]
    want = srcs[0].copy()
    with np.errstate(over="ignore"):
        for s in srcs[1:]:
            want = want + s  # in order, like the kernel
    dst = np.empty_like(srcs[0])
    _reduce.sum_many(dst, srcs, dtypes.from_name(name))
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 33, 1000003])
def test_sum_many_fp16_rounds_once(simd, nsrc, n):
    rng = np.random.default_rng(300 + nsrc * 11 + n)
    srcs = [rand_bits(rng, n) for _ in range(nsrc)]
    with np.errstate(all="ignore"):
        want = f16_sum_truth(*srcs)
    dst = np.empty(n, np.uint16)
    _reduce.sum_many(dst, srcs, dtypes.FLOAT16)
    assert_f16_equal(dst, want, *srcs)


@pytest.mark.parametrize("nsrc", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 33, 1000003])
def test_sum_many_bf16_rounds_once(simd, torch, nsrc, n):
    rng = np.random.default_rng(400 + nsrc * 11 + n)
    srcs = [rand_bits(rng, n) for _ in range(nsrc)]
    acc = bf16_to_f32(srcs[0])
    with np.errstate(all="ignore"):
        for s in srcs[1:]:
            acc = acc + bf16_to_f32(s)
    dst = np.empty(n, np.uint16)
    _reduce.sum_many(dst, srcs, dtypes.BFLOAT16)
    if nsrc == 1:  # a plain copy, signalling NaNs included
        np.testing.assert_array_equal(dst, srcs[0])
    else:
        assert_bf16_equal(dst, bf16_round_truth(torch, acc))


def test_sum_many_fp16_more_accurate_than_pairwise():
    # 1 + 4 * 2^-11: each pairwise fp16 add rounds the 2^-11 away, fp32 accumulation keeps it
    srcs = [np.ones(5, np.float16)] + [np.full(5, 2.0 ** -11, np.float16)] * 4
    dst = np.empty(5, np.float16)
    _reduce.sum_many(dst, srcs, dtypes.FLOAT16)
    assert (dst == np.float16(1 + 2.0 ** -9)).all()


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "int64"])
def test_sum_many_dst_aliases_first_source(name):
    code = dtypes.from_name(name)
    rng = np.random.default_rng(5)
    srcs = [rng.integers(0, 100, 1000, dtype=np.int64).astype(dtypes.numpy_view_dtype(code)) for _ in range(3)]
    if name == "bfloat16":
        srcs = [(s.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) for s in srcs]
    want = np.empty_like(srcs[0])
    _reduce.sum_many(want, srcs, code)
    _reduce.sum_many(srcs[0], srcs, code)
    np.testing.assert_array_equal(srcs[0], want)


def test_sum_many_readonly_and_errors():
    a = np.ones(5, np.float32)
    dst = np.empty(5, np.float32)
    _reduce.sum_many(dst, [a.tobytes(), memoryview(a.tobytes()), a], dtypes.FLOAT32)
    np.testing.assert_array_equal(dst, 3)
    with pytest.raises(ValueError, match="at least one"):
        _reduce.sum_many(dst, [], dtypes.FLOAT32)
    with pytest.raises(ValueError, match=r"srcs\[1\].*20 bytes.*16 bytes.*float32"):
        _reduce.sum_many(dst, [a, np.ones(4, np.float32)], dtypes.FLOAT32)
    with pytest.raises(ValueError, match="dtype"):
        _reduce.sum_many(dst, [a], 42)


# ---------------------------------------------------------------------------------------------
# threads, copy, scale, allocation


@pytest.fixture
def two_threads():
    old = _reduce.get_num_threads()
    _reduce.set_num_threads(2)
    yield
    _reduce.set_num_threads(old)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float64", "int32", "int8"])
def test_threaded_equals_single_threaded(two_threads, name):
    code = dtypes.from_name(name)
    n = (4 << 20) // dtypes.itemsize(code) + 13  # above the parallel threshold, odd tail
    assert n * dtypes.itemsize(code) > _reduce._get_parallel_threshold()
    rng = np.random.default_rng(9)
    raw = rng.integers(0, 256, (3, n * dtypes.itemsize(code)), dtype=np.uint8)
    a, b, c = raw[0].copy(), raw[1].copy(), raw[2].copy()
    single = a.copy()
    _reduce.set_num_threads(1)
    _reduce.sum_into(single, b, code)
    many_single = np.empty_like(a)
    _reduce.sum_many(many_single, [a, b, c], code)
    _reduce.set_num_threads(2)
    _reduce.sum_into(a, b, code)
    np.testing.assert_array_equal(a, single)
    many = np.empty_like(a)
    _reduce.sum_many(many, [raw[0], b, c], code)
    if name in ("float32", "float64"):
        # Where two inputs are NaN, which payload survives depends on the operand order the compiler
        # chose for the loop an element falls in (scalar head or tail, or vector body), and that
        # depends on the destination's alignment: any quiet NaN of the inputs is right (as for numpy).
        view = np.dtype(name)
        inputs = [x.view(view) for x in (raw[0], b, c)]
        several_nan = np.sum([np.isnan(x) for x in inputs], axis=0) >= 2
        got, want = many.view(view), many_single.view(view)
        np.testing.assert_array_equal(got.view(f"u{view.itemsize}")[~several_nan],
                                      want.view(f"u{view.itemsize}")[~several_nan])
        assert np.isnan(got[several_nan]).all() and np.isnan(want[several_nan]).all()
    else:
        np.testing.assert_array_equal(many, many_single)


def test_threaded_small_chunks(two_threads):
    """With the threshold at 0 every call splits; chunk edges must not lose or repeat elements."""
    old = _reduce._get_parallel_threshold()
    _reduce._set_parallel_threshold(0)
    try:
        for n in (1, 63, 64, 65, 129, 1000):
            a = np.arange(n, dtype=np.int32)
            _reduce.sum_into(a, np.ones(n, np.int32), dtypes.INT32)
            np.testing.assert_array_equal(a, np.arange(n) + 1)
            out = np.empty(n, np.float16)
            _reduce.sum_many(out, [np.ones(n, np.float16)] * 3, dtypes.FLOAT16)
            assert (out == 3).all()
            _reduce.copy_into(out, np.zeros(n, np.float16))
            assert (out == 0).all()
    finally:
        _reduce._set_parallel_threshold(old)


def test_num_threads():
    old = _reduce.get_num_threads()
    assert old >= 1
    _reduce.set_num_threads(3)
    assert _reduce.get_num_threads() == 3
    _reduce.set_num_threads(old)
    with pytest.raises(ValueError):
        _reduce.set_num_threads(0)


def test_num_threads_from_env():
    env = dict(os.environ, BYTEPS_OMP_THREAD_PER_GPU="3")
    out = subprocess.run([sys.executable, "-c", "from byteps.core import _reduce; print(_reduce.get_num_threads())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"


@pytest.mark.parametrize("cpus,omp,want", [(1, None, 1), (2, None, 1), (7, None, 1), (8, None, 2), (12, None, 3),
                                           (16, None, 4), (96, None, 4), (16, "8", 2), (16, "2", 1), (4, "16", 1)])
def test_default_threads_rule(monkeypatch, cpus, omp, want):
    """One kernel thread per 4 cores of the process's share (OMP_NUM_THREADS when smaller), 1..4."""
    monkeypatch.setattr(_reduce, "_usable_cpus", lambda: cpus)
    env = {} if omp is None else {"OMP_NUM_THREADS": omp}
    got, why = _reduce.default_threads(env)
    assert got == want, why
    assert _reduce.default_threads({**env, "BYTEPS_OMP_THREAD_PER_GPU": "5"}) == (5, "BYTEPS_OMP_THREAD_PER_GPU")


@pytest.mark.parametrize("bad", ["0", "65", "two", "-1"])
def test_thread_override_malformed_is_config_error(bad):
    from byteps.config import load
    from byteps.errors import ConfigError

    with pytest.raises(ConfigError, match="BYTEPS_OMP_THREAD_PER_GPU"):
        _reduce.default_threads({"BYTEPS_OMP_THREAD_PER_GPU": bad})
    with pytest.raises(ConfigError, match="BYTEPS_OMP_THREAD_PER_GPU"):
        load({"BYTEPS_OMP_THREAD_PER_GPU": bad})


def test_idle_helpers_sleep():
    """Between parallel calls the helper threads block: the process uses no CPU while it sleeps
    (libgomp's helpers spun for about a millisecond after each call)."""
    import time

    old = _reduce.get_num_threads()
    _reduce.set_num_threads(2)
    try:
        a = np.ones(1 << 20, np.float32)
        b = np.ones(1 << 20, np.float32)
        _reduce.sum_into(a, b, dtypes.FLOAT32)  # helpers started
        cpu0 = time.process_time()
        for _ in range(50):
            _reduce.sum_into(a[:1 << 17], b[:1 << 17], dtypes.FLOAT32)  # 512 KB: parallel
            time.sleep(0.002)
        cpu = time.process_time() - cpu0
        assert cpu < 0.05, f"{cpu:.3f} s of CPU in 50 small sums with 100 ms of sleep: helpers spin"
        assert (a[:1 << 17] == 52).all() and (a[1 << 17:] == 2).all()
    finally:
        _reduce.set_num_threads(old)


def test_concurrent_callers_share_the_pool():
    """Callers on several threads at once: one gets the helpers, the others sum on their own thread."""
    import threading

    old = _reduce.get_num_threads()
    _reduce.set_num_threads(3)
    try:
        bufs = [np.full(1 << 20, i, np.float32) for i in range(6)]
        one = np.ones(1 << 20, np.float32)

        def work(buf):
            for _ in range(20):
                _reduce.sum_into(buf, one, dtypes.FLOAT32)
        threads = [threading.Thread(target=work, args=(b,)) for b in bufs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, buf in enumerate(bufs):
            assert (buf == i + 20).all()
    finally:
        _reduce.set_num_threads(old)


def test_pool_after_fork():
    """A fork()ed child starts its own helpers (the parent's do not exist there)."""
    old = _reduce.get_num_threads()
    _reduce.set_num_threads(2)
    try:
        a = np.ones(1 << 20, np.float32)
        _reduce.sum_into(a, a.copy(), dtypes.FLOAT32)
        pid = os.fork()
        if pid == 0:
            try:
                _reduce.sum_into(a, a.copy(), dtypes.FLOAT32)
                os._exit(0 if (a == 4).all() else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        _reduce.set_num_threads(old)


@pytest.mark.parametrize("nbytes", [0, 1, 4097, 3 << 20])
def test_copy_into(two_threads, nbytes):
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    _reduce.copy_into(dst, src.tobytes())
    np.testing.assert_array_equal(dst, src)
    with pytest.raises(ValueError, match="bytes"):
        _reduce.copy_into(dst, bytes(nbytes + 1))


@pytest.mark.parametrize("nbytes", [1 << 20, (3 << 20) + 37])
@pytest.mark.parametrize("offset", [0, 1, 13])
def test_copy_into_streaming_any_alignment(nbytes, offset):
    """stream=True (a result into the caller's tensor, a partition staged for a server) takes the
    non-temporal path from 1 MB on: every byte lands, whatever the destination's alignment and the
    tail's length, and nothing beyond it."""
    old = _reduce.get_num_threads()
    _reduce.set_num_threads(1)  # the streaming copy runs where the kernels run on one thread
    try:
        src = np.random.default_rng(nbytes + offset).integers(0, 256, nbytes, dtype=np.uint8)
        buf = np.full(nbytes + offset + 64, 7, np.uint8)
        _reduce.copy_into(buf[offset:offset + nbytes], src, stream=True)
        np.testing.assert_array_equal(buf[offset:offset + nbytes], src)
        assert (buf[:offset] == 7).all() and (buf[offset + nbytes:] == 7).all()
    finally:
        _reduce.set_num_threads(old)


@pytest.mark.parametrize("n", [0, 1, 17, 1000003])
def test_scale_floats(simd, torch, n):
    rng = np.random.default_rng(n)
    f = 1.0 / 3.0
    a32 = rng.standard_normal(n).astype(np.float32)
    want32 = a32 * np.float32(f)
    _reduce.scale(a32, f, dtypes.FLOAT32)
    np.testing.assert_array_equal(a32, want32)
    a64 = rng.standard_normal(n)
    want64 = a64 * f
    _reduce.scale(a64, f, dtypes.FLOAT64)
    np.testing.assert_array_equal(a64, want64)
    h = rand_bits(rng, n)
    with np.errstate(all="ignore"):
        want16 = (h.view(np.float16).astype(np.float32) * np.float32(f)).astype(np.float16).view(np.uint16)
    _reduce.scale(h, f, dtypes.FLOAT16)
    np.testing.assert_array_equal(h, want16)
    bf = rand_bits(rng, n)
    with np.errstate(all="ignore"):
        wantbf = bf16_round_truth(torch, bf16_to_f32(bf) * np.float32(f))
    _reduce.scale(bf, f, dtypes.BFLOAT16)
    assert_bf16_equal(bf, wantbf)


@pytest.mark.parametrize("code", [dtypes.INT32, dtypes.INT64, dtypes.UINT8, dtypes.INT8])
def test_scale_rejects_integers(code):
    with pytest.raises(ValueError, match="floor division"):
        _reduce.scale(np.zeros(8, np.int64), 0.5, code)
    with pytest.raises(ValueError, match="dtype"):
        _reduce.scale(np.zeros(8, np.int64), 0.5, 17)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4097, 1 << 20])
def test_aligned_empty(nbytes):
    arr = _reduce.aligned_empty(nbytes)
    assert arr.dtype == np.uint8 and arr.shape == (nbytes,)
    assert arr.ctypes.data % 4096 == 0
    assert arr.flags.c_contiguous and arr.flags.writeable
    arr[:] = 7  # the whole range is usable
    with pytest.raises(ValueError):
        _reduce.aligned_empty(-1)


def test_cpu_features():
    feats = _reduce.cpu_features()
    assert {"avx2", "f16c", "avx512bf16"} <= set(feats)
    assert all(isinstance(v, bool) for v in feats.values())


# ---------------------------------------------------------------------------------------------
# properties


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), max_size=70), st.integers(0, 2**32 - 1))
def test_property_fp16_matches_numpy(bits, seed):
    a = np.array(bits, np.uint16)
    b = np.random.default_rng(seed).integers(0, 1 << 16, len(a), dtype=np.uint16)
    with np.errstate(all="ignore"):
        want = f16_sum_truth(a, b)
    got = a.copy()
    _reduce.sum_into(got, b, dtypes.FLOAT16)
    assert_f16_equal(got, want, a, b)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(0, 300), st.integers(0, 2**32 - 1))
def test_property_sum_many_int32_wraps(nsrc, n, seed):
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(-2**31, 2**31, n, dtype=np.int32) for _ in range(nsrc)]
    want = np.sum(np.stack(srcs).astype(np.int64), axis=0).astype(np.int32) if n else np.zeros(0, np.int32)
    dst = np.empty(n, np.int32)
    _reduce.sum_many(dst, srcs, dtypes.INT32)
    np.testing.assert_array_equal(dst, want)
