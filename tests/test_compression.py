"""Wire compression (byteps/compression.py), in one process: codecs against reference
implementations written here, error feedback's invariant, reproducible random streams, the wire
format and the configuration. The multi-process jobs are in test_compression_jobs.py.
"""
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_compression
from byteps import compression as C  # noqa: E402
from byteps.errors import ConfigError  # noqa: E402
from codec_reference import derive_seed as ref_seed  # noqa: E402

F32, F64 = 0, 1
NP = {F32: np.float32, F64: np.float64}
KEY = (5 << 32) | 3


def codec(method, **kw):
    return C.WireCompressor(method, **{"min_bytes": 0, **kw})


def encode(c, x, key=KEY, rnd=1, stream=0):
    return c.encode(x.view(np.uint8), F32 if x.dtype == np.float32 else F64, key, rnd, stream)


# ------------------------------------------------------------------------------ reference codecs


def ref_round(v, precision, emin, maxval):
    """Exact round-to-nearest-even of a Python float to a binary format (precision bits including the
    implicit one, smallest normal exponent emin), with Fractions: independent of numpy's casts."""
    if math.isnan(v) or math.isinf(v) or v == 0:
        return v
    a = abs(v)
    _, ex = math.frexp(a)  # a = m * 2^ex, m in [0.5, 1): the leading bit is 2^(ex-1)
    quantum = Fraction(2) ** (max(ex - 1, emin) - (precision - 1))
    r = round(Fraction(a) / quantum) * quantum  # Fraction.__round__ rounds half to even
    if r > maxval:
        return math.copysign(math.inf, v)
    return math.copysign(float(r), v)


FP16_FMT = (11, -14, 65504.0)
BF16_FMT = (8, -126, float((2 - Fraction(1, 128)) * Fraction(2) ** 127))


def cast_cases(dtype):
    g = np.random.default_rng(11)
    x = np.concatenate([
        g.standard_normal(3000) * 10.0 ** g.integers(-9, 9, 3000),
        # exact halfway cases between neighbours, their neighbours, the overflow edge, subnormals
        [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -30,
         65504.0, 65519.0, 65520.0, 1e5, -1e5, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-30, 3.3e38, 3.4e38,
         -0.0, 0.0, np.inf, -np.inf, np.nan],
    ])
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method,fmt", [("fp16", FP16_FMT), ("bf16", BF16_FMT)])
def test_casts_round_to_nearest_even_like_the_reference(method, fmt, dtype):
    x = cast_cases(dtype)
    blob = encode(codec(method), x)
    assert len(blob) == C.HEADER_SIZE + 2 * x.size
    got = C.decode(blob)
    assert got.dtype == dtype
    want = np.array([ref_round(float(v), *fmt) for v in x], dtype=np.float64)
    same = (got.astype(np.float64) == want) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, [(float(x[i]), float(got[i]), want[i]) for i in bad[:5]]
    # signed zeros keep their sign
    assert np.array_equal(np.signbit(got[x == 0]), np.signbit(x[x == 0]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scaling", [True, False])
def test_onebit_is_signs_and_mean_magnitude(dtype, scaling):
    g = np.random.default_rng(1)
    x = (g.standard_normal(10001) * 3).astype(dtype)
    x[:3] = 0.0
    blob = encode(codec("onebit", scaling=scaling), x)
    assert len(blob) == C.HEADER_SIZE + 8 + (x.size + 7) // 8
    scale = float(np.frombuffer(blob[C.HEADER_SIZE:C.HEADER_SIZE + 8], "<f8")[0])
    want_scale = math.fsum(abs(float(v)) for v in x) / x.size if scaling else 1.0
    assert scale == pytest.approx(want_scale, rel=1e-12)
    s = dtype(scale)
    want = np.array([-s if v < 0 else s for v in x], dtype=dtype)  # zero counts as positive
    np.testing.assert_array_equal(C.decode(blob), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k,n", [(0.01, 20000), (37, 1000), (1, 5)])
def test_topk_sends_the_k_largest_magnitudes(dtype, k, n):
    g = np.random.default_rng(2)
    x = g.standard_normal(n).astype(dtype)
    kk = max(1, math.ceil(k * n)) if k < 1 else int(k)
    blob = encode(codec("topk", k=k), x)
    assert len(blob) == C.HEADER_SIZE + kk * (4 + x.itemsize)
    got = C.decode(blob)
    sel = np.flatnonzero(got)
    assert sel.size == kk
    np.testing.assert_array_equal(got[sel], x[sel])
    rest = np.setdiff1d(np.arange(n), sel)
    if rest.size:
        assert np.abs(x[sel]).min() >= np.abs(x[rest]).max()


def ref_random_indices(seed, key, rnd, n, k):
    """Documented stream: SeedSequence(seed, key, round words) -> PCG64 raw outputs -> candidate
    floor((r >> 11) * n / 2**53), the first k distinct ones (a plain Python loop)."""
    words = [seed & 0xFFFFFFFF, seed >> 32, key & 0xFFFFFFFF, key >> 32, rnd & 0xFFFFFFFF, rnd >> 32]
    s64 = int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])
    raw = np.random.PCG64(s64).random_raw(50 * k + 1000)
    chosen, seen = [], set()
    for r in raw.tolist():
        i = min(int(float(r >> 11) * (n / float(1 << 53))), n - 1)
        if i not in seen:
            seen.add(i)
            chosen.append(i)
            if len(chosen) == k:
                break
    assert len(chosen) == k
    return np.array(sorted(chosen))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k,n", [(0.01, 30000), (0.5, 2000), (200, 1000)])
def test_randomk_indices_follow_the_documented_stream(dtype, k, n):
    x = np.random.default_rng(3).standard_normal(n).astype(dtype)
    kk = max(1, math.ceil(k * n)) if k < 1 else int(k)
    blob = encode(codec("randomk", k=k, seed=99), x, key=KEY, rnd=7)
    assert len(blob) == C.HEADER_SIZE + kk * x.itemsize  # values only: no indices travel
    idx = ref_random_indices(99, KEY, 7, n, kk)
    want = np.zeros(n, dtype)
    want[idx] = x[idx]
    np.testing.assert_array_equal(C.decode(blob), want)
    # another round or another seed draws other indices
    other = C.decode(encode(codec("randomk", k=k, seed=99), x, key=KEY, rnd=8))
    assert not np.array_equal(np.flatnonzero(other), idx)


def test_random_streams_are_the_same_in_another_process():
    """Seeds make random methods reproducible across workers: a fresh interpreter encodes the same bytes."""
    code = ("import numpy as np, byteps.compression as C, hashlib\n"
            "x = np.arange(50000, dtype=np.float32) % 17 - 8\n"
            "out = []\n"
            "for m, kw in [('randomk', {'k': 0.02}), ('dithering', {'levels': 7})]:\n"
            "    c = C.WireCompressor(m, min_bytes=0, seed=1234, **kw)\n"
            "    out.append(hashlib.sha256(c.encode(x.view(np.uint8), 0, (9 << 32) | 2, 5, 1)).hexdigest())\n"
            "print(' '.join(out))\n")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
            .stdout.split() for _ in range(2)]
    assert runs[0] == runs[1]
    import hashlib
    x = np.arange(50000, dtype=np.float32) % 17 - 8
    here = [hashlib.sha256(codec(m, seed=1234, **kw).encode(x.view(np.uint8), 0, (9 << 32) | 2, 5, 1)).hexdigest()
            for m, kw in [("randomk", {"k": 0.02}), ("dithering", {"levels": 7})]]
    assert here == runs[0]


def ref_dither(x, levels, natural, norm, seed64):
    """Per-element stochastic rounding, with the documented draws: u = (w >> 8) / 2**24 for the 32-bit
    words w of PCG64's output, low word first; in x's dtype."""
    dt = x.dtype.type
    raw = np.random.PCG64(seed64).random_raw((x.size + 1) // 2).tolist()
    words = [w for r in raw for w in (r & 0xFFFFFFFF, r >> 32)]
    out = np.empty(x.size, np.float64)
    for j, v in enumerate(x):
        u = dt(words[j] >> 8) * dt(1.0 / (1 << 24))
        a = dt(abs(v))
        if natural:
            p = a / dt(norm)
            e = max(math.frexp(float(p))[1] - 1, -levels)
            if p == 0:
                out[j] = 0.0
                continue
            if e < 1 - levels:
                lo_idx, lo_val, step = 0, dt(0), dt(2.0 ** (1 - levels))
            else:
                lo_idx, lo_val, step = e + levels, dt(2.0 ** e), dt(2.0 ** e)
            lv = min(lo_idx + int(u < (p - lo_val) / step), levels)
            unit = 2.0 ** (lv - levels) if lv > 0 else 0.0
        else:
            sp = a * dt(levels / norm)
            lo = np.floor(sp)
            lv = min(int(lo) + int(u < sp - lo), levels)
            unit = lv / float(levels)
        out[j] = (-1.0 if v < 0 and lv else 1.0 if lv else 0.0) * unit * norm
    return out.astype(x.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("levels,partition,normalize", [(7, "linear", "max"), (1, "linear", "l2"),
                                                        (127, "linear", "max"), (5, "natural", "max"),
                                                        (1000, "natural", "l2")])
def test_dithering_matches_the_reference(dtype, levels, partition, normalize):
    x = (np.random.default_rng(4).standard_normal(3001) * 2).astype(dtype)
    x[5] = 0
    blob = encode(codec("dithering", levels=levels, partition=partition, normalize=normalize, seed=7),
                  x, key=KEY, rnd=2, stream=1)
    bits = next(b for b in (2, 4, 8, 16) if b >= (2 * levels).bit_length())
    assert len(blob) == C.HEADER_SIZE + 8 + (x.size * bits + 7) // 8
    norm = float(np.frombuffer(blob[C.HEADER_SIZE:C.HEADER_SIZE + 8], "<f8")[0])
    a = np.abs(x.astype(np.float64))
    want_norm = math.sqrt(math.fsum(v * v for v in a)) if normalize == "l2" else float(a.max())
    assert norm == pytest.approx(want_norm, rel=1e-12)
    seed64 = ref_seed(7, KEY, 2, 1)
    np.testing.assert_array_equal(C.decode(blob), ref_dither(x, levels, partition == "natural", norm, seed64))


@pytest.mark.parametrize("partition", ["linear", "natural"])
def test_dithering_is_unbiased(partition):
    """Stochastic rounding: the mean over many rounds converges to the input."""
    x = np.random.default_rng(5).standard_normal(500).astype(np.float64)
    c = codec("dithering", levels=3, partition=partition)
    rounds = 800
    mean = sum(C.decode(encode(c, x, rnd=r)) for r in range(rounds)) / rounds
    # largest gap between levels: norm / s (linear); norm / 2, between 1/2 and 1 (natural)
    step = np.abs(x).max() / (3 if partition == "linear" else 2)
    sigma = (step / 2) / math.sqrt(rounds)  # bound on the std of one element's mean
    assert np.abs(mean - x).max() < 5 * sigma
    assert abs(float(np.mean(mean - x))) < 5 * sigma / math.sqrt(x.size)  # no bias overall
    assert np.abs(mean - x).max() > 0  # it is random at all


# ------------------------------------------------------------------------------ error feedback, momentum

EXACT_EF = ["fp16", "bf16", "topk", "randomk"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method", ["fp16", "bf16", "onebit", "topk", "randomk", "dithering"])
def test_error_feedback_invariant(method, dtype):
    """residual_new == (input + residual_old) - decoded, bit for bit, every round. For casts and
    sparsifiers decoded + residual_new == input + residual_old exactly as well; for onebit and
    dithering that sum is only within one rounding of the subtraction (an exact float equality is
    impossible: 1e-8 - 1.0 is not representable in float32), checked to one ulp."""
    c = codec(method, error_feedback=True, k=0.05) if method in ("topk", "randomk") else codec(
        method, error_feedback=True)
    g = np.random.default_rng(6)
    res = np.zeros(4000, dtype)
    total_in, total_out = np.zeros(4000), np.zeros(4000)
    for rnd in range(1, 8):
        x = (g.standard_normal(4000) * 10.0 ** g.integers(-3, 3, 4000)).astype(dtype)
        v = x + res
        blob = encode(c, x, rnd=rnd)
        d = C.decode(blob)
        new = c.residual(KEY)
        assert new.dtype == dtype
        np.testing.assert_array_equal(new, v - d)
        if method in EXACT_EF:
            np.testing.assert_array_equal(d + new, v)
        else:
            ulp = np.spacing(np.maximum(np.abs(v), np.abs(d)).astype(dtype))
            assert np.all(np.abs((d + new) - v) <= 2 * ulp)  # two roundings: the residual's and this sum's
        assert blob[5] & C.F_EF  # the server is told to keep a residual for its reply
        total_in += x
        total_out += d
        res = new
    # nothing is lost: what was sent plus what is still held is what came in
    np.testing.assert_allclose(total_out + res, total_in, rtol=1e-5, atol=1e-5 * np.abs(total_in).max())


def test_error_feedback_restarts_at_round_zero_and_on_resize():
    c = codec("onebit", error_feedback=True)
    x = np.linspace(-1, 2, 1000, dtype=np.float32)
    encode(c, x, rnd=1)
    assert np.abs(c.residual(KEY)).max() > 0
    encode(c, x, rnd=0)  # a new epoch (init/join) starts over
    np.testing.assert_array_equal(c.residual(KEY), x - C.decode(encode(codec("onebit"), x, rnd=0)))
    encode(c, x[:500], rnd=1)  # a resized tensor under the same key
    assert c.residual(KEY).size == 500


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction(nesterov):
    """m = mu * m + g on the worker; m (or g + mu * m) is what gets compressed."""
    c = codec("fp16", momentum=0.9, nesterov=nesterov)
    g = np.random.default_rng(7)
    m = np.zeros(1000, np.float32)
    for rnd in range(1, 6):
        x = g.standard_normal(1000).astype(np.float32)
        m = m * np.float32(0.9) + x
        sent = x + np.float32(0.9) * m if nesterov else m
        np.testing.assert_array_equal(C.decode(encode(c, x, rnd=rnd)), sent.astype(np.float16).astype(np.float32))


# ------------------------------------------------------------------------------ wire format, configuration


def test_parse_refuses_malformed_blobs_with_clear_errors():
    x = np.random.default_rng(8).standard_normal(1000).astype(np.float32)
    blob = encode(codec("topk", k=10), x)
    with pytest.raises(C.CodecError, match="shorter than"):
        C.parse(blob[:10])
    with pytest.raises(C.CodecError, match="magic"):
        C.parse(b"XX" + blob[2:])
    with pytest.raises(C.CodecError, match="version"):
        C.parse(blob[:2] + b"\x09" + blob[3:])
    with pytest.raises(C.CodecError, match="method"):
        C.parse(blob[:3] + b"\x63" + blob[4:])
    with pytest.raises(C.CodecError, match="should be"):
        C.parse(blob + b"\0")
    idx = np.frombuffer(blob[C.HEADER_SIZE:C.HEADER_SIZE + 40], np.uint32).copy()
    for bad in (idx[::-1], np.r_[idx[:-1], 5000], np.r_[idx[:-1], idx[-2]]):  # unsorted, out of range, repeated
        broken = blob[:C.HEADER_SIZE] + bad.astype(np.uint32).tobytes() + blob[C.HEADER_SIZE + 40:]
        with pytest.raises(C.CodecError, match="indices"):
            C.decode(broken)
    with pytest.raises(C.CodecError, match="destination"):
        C.decode_into(C.parse(blob), np.empty(999, np.float32))


def test_applies_only_where_it_saves_bytes():
    c = C.WireCompressor("onebit", min_bytes=1000)
    assert c.applies(F32, 4000, 4000)
    assert not c.applies(F32, 999, 999)            # small tensor
    assert c.applies(F32, 4000, 400)              # a small partition of a large tensor is compressed
    assert not c.applies(F32, 4000, 4)            # a blob not smaller than the raw bytes: sent raw
    assert not c.applies(2, 4000, 4000)           # float16 tensors are not compressed
    assert not c.applies(4, 4000, 4000)           # nor integers
    assert not codec("topk", k=0.6).applies(F32, 4000, 4000)  # 8 bytes per kept element: larger
    assert codec("randomk", k=0.6).applies(F32, 4000, 4000)


def test_options_are_validated():
    for kw in ({"k": 0}, {"k": 1.5}, {"ratio": 2}, {"k": 0.1, "ratio": 0.1}, {"levels": 3}):
        with pytest.raises(ValueError):
            C.WireCompressor("topk", **kw)
    with pytest.raises(ValueError, match="unknown compression method"):
        C.WireCompressor("zip")
    with pytest.raises(ValueError):
        C.WireCompressor("dithering", levels=0)
    with pytest.raises(ValueError):
        C.WireCompressor("onebit", momentum=1.0)
    c = C.WireCompressor("topk", ratio=0.001, error_feedback=True)
    assert c.k == 0.001 and c(k=0.5).k == 0.5 and c(k=0.5).error_feedback  # calling copies with changes
    assert "0.001" in repr(c)


def test_environment_configuration():
    assert C.from_env({}) is None
    c = C.from_env({"BYTEPS_COMPRESSOR": "topk", "BYTEPS_COMPRESSOR_K": "0.05", "BYTEPS_ERROR_FEEDBACK": "1",
                    "BYTEPS_MOMENTUM_MU": "0.9", "BYTEPS_COMPRESSOR_SEED": "3", "BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert (c.method, c.k, c.error_feedback, c.momentum, c.seed, c.min_bytes) == ("topk", 0.05, True, 0.9, 3, 0)
    assert C.from_env({"BYTEPS_COMPRESSOR": "dithering", "BYTEPS_COMPRESSOR_K": "31"}).levels == 31
    for env, name in [({"BYTEPS_COMPRESSOR": "zip"}, "BYTEPS_COMPRESSOR"),
                      ({"BYTEPS_COMPRESSOR": "topk", "BYTEPS_COMPRESSOR_K": "x"}, "BYTEPS_COMPRESSOR_K"),
                      ({"BYTEPS_COMPRESSOR": "topk", "BYTEPS_COMPRESSOR_K": "2.5"}, "BYTEPS_COMPRESSOR_K"),
                      ({"BYTEPS_COMPRESSOR": "onebit", "BYTEPS_ERROR_FEEDBACK": "maybe"}, "BYTEPS_ERROR_FEEDBACK"),
                      ({"BYTEPS_COMPRESSOR": "onebit", "BYTEPS_MIN_COMPRESS_BYTES": "-1"},
                       "BYTEPS_MIN_COMPRESS_BYTES")]:
        with pytest.raises(ConfigError, match=name):
            C.from_env(env)


def test_resolve_and_plugin_compression_objects():
    import byteps.torch as bps
    from byteps.torch.compression import FP16Compressor, select

    assert C.resolve(False) is None
    onebit = bps.Compression.onebit(error_feedback=True)
    assert C.resolve(onebit) is onebit and onebit.error_feedback
    assert bps.Compression.fp16 is FP16Compressor  # Horovod's tensor cast is unchanged
    assert C.resolve(bps.Compression.fp16) is C.default_codec()
    import torch
    t = torch.ones(3)
    assert onebit.compress(t)[0] is t and onebit.decompress(t, None) is t
    per = {"fc.weight": onebit, "*.bias": bps.Compression.fp16}
    assert select(per, "fc.weight") is onebit and select(per, "fc.bias") is FP16Compressor
    assert select(per, "other") is bps.Compression.none
    with pytest.raises(TypeError, match="compression must be"):
        C.resolve("onebit")


def test_mxnet_compression_params():
    c = C.from_params({"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "momentum_mu": 0.8,
                       "scaling": "false"})
    assert (c.method, c.error_feedback, c.momentum, c.nesterov, c.scaling) == ("onebit", True, 0.8, True, False)
    assert C.from_params({"compressor": "dithering", "k": 7, "partition": "natural"}).levels == 7
    assert C.from_params(None) is None
    with pytest.raises(ValueError, match="unsupported keys"):
        C.from_params({"compressor": "topk", "compresor_k": 3})
    with pytest.raises(NotImplementedError, match="fp16"):
        C.from_params({"compressor": "topk", "fp16": True})
