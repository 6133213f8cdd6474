"""The native wire codecs (core/kernels/bps_codecs.h, through byteps.compression) byte for byte
against the numpy model in tests/codec_reference.py: every method, both dtypes, odd lengths,
special values, momentum and error feedback over several rounds, the server's recompressed reply,
the random streams against numpy's own SeedSequence and PCG64, and the texts of malformed blobs.
"""
import math
import os
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import codec_reference as ref  # noqa: E402

from byteps import compression as C  # noqa: E402

KEY = (11 << 32) | 4
LENGTHS = [1, 2, 7, 9, 31, 1001, 4097]
METHODS = [("fp16", {}), ("bf16", {}), ("onebit", {}), ("onebit", {"scaling": False}), ("topk", {"k": 0.1}),
           ("topk", {"k": 3}), ("randomk", {"k": 0.3, "seed": 5}), ("randomk", {"k": 2, "seed": 2 ** 63 + 9}),
           ("dithering", {"levels": 1}), ("dithering", {"levels": 7, "normalize": "l2"}),
           ("dithering", {"levels": 100, "partition": "natural"}),
           ("dithering", {"levels": 1000, "partition": "natural", "normalize": "l2", "seed": 2 ** 40})]


def codec(method, **kw):
    return C.WireCompressor(method, min_bytes=0, **kw)


def values(n, dtype, seed=0):
    g = np.random.default_rng(seed)
    x = (g.standard_normal(n) * 10.0 ** g.integers(-4, 4, n)).astype(dtype)
    special = np.array([0.0, -0.0, 1.5, -1.5, 1.5, 1e-40, 65519.0, 3.0e38][:max(0, n - 1)], dtype)
    x[:special.size] = special  # zeros, ties, a float32 subnormal, fp16's rounding edge
    return x


def kept(k, n):
    return max(1, min(n, math.ceil(k * n))) if k < 1 else min(n, int(k))


def expected_blob(c, x, blob, key, rnd, stream):
    """The reference's blob for what ``c`` sent, with the scale/norm read from ``blob`` once it is
    checked against an exactly rounded sum."""
    n, scale = x.size, None
    if c.method == "onebit" or c.method == "dithering":
        scale = struct.unpack("<d", blob[32:40])[0]
        a = np.abs(x.astype(np.float64))
        if c.method == "onebit":
            want = math.fsum(a) / n if c.scaling else 1.0
        else:
            want = math.sqrt(math.fsum(a * a)) if c.normalize == "l2" else float(a.max())
        assert scale == pytest.approx(want, rel=1e-14, abs=0)
    k = kept(c.k, n) if c.method in ("topk", "randomk") else 0
    seed = ref.derive_seed(c.seed, key, rnd) if c.method == "randomk" else c.seed
    dither_seed = ref.derive_seed(c.seed, key, rnd, stream) if c.method == "dithering" else None
    return ref.encode(C.METHODS[c.method], x, c.flags, k=k, levels=c.levels, seed=seed, dither_seed=dither_seed,
                      scale=scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method,opts", METHODS, ids=lambda v: str(v))
def test_encode_and_decode_match_the_reference_byte_for_byte(method, opts, dtype):
    for n in LENGTHS:
        x = values(n, dtype, seed=n)
        c = codec(method, **opts)
        blob = c.encode(x.view(np.uint8), 0 if dtype == np.float32 else 1, KEY, 3, 1)
        want = expected_blob(c, x, blob, KEY, 3, 1)
        assert blob == want, (method, opts, n)
        decoded = C.decode(blob)
        np.testing.assert_array_equal(decoded, ref.decode(want), err_msg=f"{method} {opts} n={n}")
        acc = values(n, dtype, seed=99)
        C.decode_into(C.parse(blob), acc, accumulate=True)
        np.testing.assert_array_equal(acc, ref.decode(want, values(n, dtype, seed=99)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_non_finite_values(dtype):
    x = np.array([1.0, np.nan, -np.inf, 2.0, -0.0, np.inf, 3.0], dtype)
    for method, opts in [("fp16", {}), ("bf16", {}), ("topk", {"k": 2}), ("dithering", {"levels": 3})]:
        c = codec(method, **opts)
        blob = c.encode(x.view(np.uint8), 0 if dtype == np.float32 else 1, KEY, 1, 0)
        if method == "dithering":  # a non-finite norm: every value decodes to NaN
            assert math.isnan(struct.unpack("<d", blob[32:40])[0]) and np.isnan(C.decode(blob)).all()
            continue
        want = expected_blob(c, x, blob, KEY, 1, 0)
        got, model = C.decode(blob), ref.decode(want)
        assert np.array_equal(got, model, equal_nan=True), method
        if method == "topk":  # NaN counts as the largest magnitude
            assert np.isnan(got[1]) and np.flatnonzero(~np.isnan(got) & (got != 0)).size == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method,opts", [("fp16", {"momentum": 0.9}), ("onebit", {"momentum": 0.5, "nesterov": True}),
                                         ("topk", {"k": 0.05}), ("randomk", {"k": 0.2, "seed": 1}),
                                         ("dithering", {"levels": 5, "partition": "natural"}), ("bf16", {})])
def test_error_feedback_and_momentum_over_rounds_match_the_reference(method, opts, dtype):
    """The worker's state machine: m = mu m + g; v = m (or g + mu m) + residual; residual = v - decode."""
    n = 1003
    c = codec(method, error_feedback=True, **opts)
    mu = dtype(opts.get("momentum", 0.0))
    m, residual = np.zeros(n, dtype), None
    g = np.random.default_rng(4)
    for rnd in range(6):
        x = (g.standard_normal(n) * 10.0 ** g.integers(-2, 2, n)).astype(dtype)
        v = x
        if mu:
            m = m * mu + x
            v = x + mu * m if opts.get("nesterov") else m
        if residual is not None:
            v = v + residual
        blob = c.encode(x.view(np.uint8), 0 if dtype == np.float32 else 1, KEY, rnd, 2)
        want = expected_blob(c, v, blob, KEY, rnd, 2)
        assert blob == want, rnd
        residual = v - ref.decode(want)
        np.testing.assert_array_equal(c.residual(KEY), residual)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method,opts", [("fp16", {"error_feedback": True}), ("onebit", {"error_feedback": True}),
                                         ("dithering", {"levels": 7, "error_feedback": True}),
                                         ("topk", {"k": 0.01}), ("topk", {"k": 0.4}), ("randomk", {"k": 0.1})])
def test_server_recompression_matches_the_reference(method, opts, dtype):
    """Decode two workers' pushes into a sum, re-encode it for the reply (with the server's own
    residual where the pushes use error feedback) over three rounds."""
    n, stream = 2001, 7
    code = 0 if dtype == np.float32 else 1
    workers = [codec(method, **opts) for _ in range(2)]
    server_residual = model_residual = None
    g = np.random.default_rng(8)
    for rnd in range(3):
        blobs = [w.encode((g.standard_normal(n)).astype(dtype).view(np.uint8), code, KEY, rnd, r)
                 for r, w in enumerate(workers)]
        total = np.empty(n, dtype)
        C.decode_into(C.parse(blobs[0]), total)
        C.decode_into(C.parse(blobs[1]), total, accumulate=True)
        np.testing.assert_array_equal(total, ref.decode(blobs[1], ref.decode(blobs[0])))
        info = C.parse(blobs[0])
        reply, server_residual = C.recompress(info, total, KEY, rnd, stream, server_residual)
        m = info.method
        if m in (C.TOPK, C.SPARSE):
            sparse = ref.encode(ref.SPARSE, total, info.flags & ~C.F_EF)
            assert reply == (None if len(sparse) >= total.nbytes else sparse)
            assert server_residual is None
            continue
        if m == C.RANDOMK:
            assert reply == ref.encode(m, total, info.flags & ~C.F_EF, k=info.k, seed=info.seed)
            np.testing.assert_array_equal(C.decode(reply), total)  # exact: the same indices
            continue
        v = total if model_residual is None else total + model_residual
        scale = struct.unpack("<d", reply[32:40])[0] if m in (C.ONEBIT, C.DITHERING) else None
        want = ref.encode(m, v, info.flags, levels=info.levels, seed=info.seed, scale=scale,
                          dither_seed=ref.derive_seed(info.seed, KEY, rnd, stream) if m == C.DITHERING else None)
        assert reply == want, rnd
        model_residual = v - ref.decode(want)
        np.testing.assert_array_equal(server_residual, model_residual)


@pytest.mark.parametrize("seed,key,rnd", [(0, 0, 0), (99, KEY, 7), (2 ** 64 - 1, 2 ** 63 + 5, 2 ** 40)])
def test_streams_are_numpys_seed_sequence_and_pcg64(seed, key, rnd):
    for stream in (None, 0, 3, 2 ** 31):
        assert C.derive_seed(seed, key, rnd, stream) == ref.derive_seed(seed, key, rnd, stream)
    s64 = ref.derive_seed(seed, key, rnd)
    for n, k in [(1, 1), (10, 9), (1000, 999), (30000, 300), (5000, 2500), (7, 7), (100, 1)]:
        np.testing.assert_array_equal(C.random_indices(s64, n, k), ref.random_indices(s64, n, k))
    for s64 in (0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 64 - 1):  # one- and two-word seeds
        np.testing.assert_array_equal(C.random_indices(s64, 50, 20), ref.random_indices(s64, 50, 20))


def test_malformed_blobs_name_what_is_wrong():
    x = values(1000, np.float32)
    blob = codec("topk", k=10).encode(x.view(np.uint8), 0, KEY, 1)
    cases = [(blob[:10], "compressed body of 10 bytes is shorter than its 32-byte header"),
             (b"X'" + blob[2:], "bad compression magic b\"X'\""),
             (b"\x00Z" + blob[2:], "bad compression magic b'\\x00Z'"),
             (blob[:2] + b"\x09" + blob[3:], "compression version 9 is not supported (this build speaks 1)"),
             (blob[:3] + b"\x63" + blob[4:], "unknown compression method 99"),
             (blob[:4] + b"\x02" + blob[5:], "compressed values of dtype code 2; only float32 and float64 are compressed"),
             (blob[:16] + struct.pack("<Q", 1001) + blob[24:], "topk sends k=1001 of n=1000 elements"),
             (blob + b"\0", "topk body of n=1000 elements should be 112 bytes, got 113")]
    dith = codec("dithering", levels=3).encode(x.view(np.uint8), 0, KEY, 1)
    cases.append((dith[:6] + b"\0\0" + dith[8:], "dithering with 0 levels"))
    for bad, text in cases:
        with pytest.raises(C.CodecError) as e:
            C.parse(bad)
        assert str(e.value) == text
    idx = np.frombuffer(blob[32:72], np.uint32)
    broken = blob[:32] + np.r_[idx[:-1], idx[-2]].astype(np.uint32).tobytes() + blob[72:]
    with pytest.raises(C.CodecError, match=r"^topk indices are not increasing within 0\.\.999$"):
        C.decode(broken)
    # levels 3 take 4 bits: 0xF is above 2 * 3
    with pytest.raises(C.CodecError, match=r"^dithering level out of range 0\.\.6$"):
        C.decode(dith[:40] + b"\xff" + dith[41:])


def test_the_kernel_refuses_what_would_overrun_its_buffers():
    from byteps.core import _reduce

    x = np.array([0, 1, 0, 2], np.float32)
    with pytest.raises(ValueError, match="non-zeros"):
        _reduce.codec_compress(C.SPARSE, 0, 0, 0, 3, 0, 0, x)  # two non-zeros, not three
    for method, k in ((C.TOPK, 0), (C.TOPK, 5), (C.RANDOMK, 5)):
        with pytest.raises(ValueError, match="k="):
            _reduce.codec_compress(method, 0, 0, 0, k, 0, 0, x)
    with pytest.raises(ValueError, match="levels"):
        _reduce.codec_compress(C.DITHERING, 0, 0, 0, 0, 0, 0, x)
    assert C.decode(_reduce.codec_compress(C.SPARSE, 0, 0, 0, 2, 0, 0, x)).tolist() == [0, 1, 0, 2]
