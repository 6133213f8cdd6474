"""A numpy model of the wire codecs (docs/compression.md), for tests/test_codec_kernels.py.

Written from the documented format, independently of core/kernels/bps_codecs.h: vectorised numpy
with numpy's own SeedSequence and PCG64 for the random streams. The only values it does not
compute itself are onebit's scale and dithering's norm (a sum whose order is the kernel's): the
test checks those against math.fsum and passes them in (``scale=``), so every other byte of a blob
is compared exactly.
"""
import math
import struct

import numpy as np

HEADER = struct.Struct("<2sBBBBHQQQ")
FP16, BF16, ONEBIT, TOPK, RANDOMK, DITHERING, SPARSE = range(1, 8)
F_EF, F_SCALING, F_NATURAL, F_L2 = 1, 2, 4, 8
NP = {0: np.dtype(np.float32), 1: np.dtype(np.float64)}


def header(method, dtype, flags, n, k=0, seed=0, levels=0):
    return HEADER.pack(b"CZ", 1, method, dtype, flags, levels, n, k, seed)


def level_bits(levels):
    need = (2 * levels).bit_length()
    return next(b for b in (2, 4, 8, 16) if b >= need)


def derive_seed(seed, key, rnd, stream=None):
    words = [seed & 0xFFFFFFFF, seed >> 32, key & 0xFFFFFFFF, key >> 32, rnd & 0xFFFFFFFF, rnd >> 32]
    if stream is not None:
        words.append(stream & 0xFFFFFFFF)
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])


def random_indices(seed64, n, k):
    """The first k distinct candidates floor((r >> 11) * n / 2**53) of PCG64(seed64), sorted."""
    if k >= n:
        return np.arange(n, dtype=np.uint32)
    raw = np.random.PCG64(seed64).random_raw(int(-n * math.log1p(-k / n) * 2) + 256)
    cand = np.minimum(((raw >> np.uint64(11)).astype(np.float64) * (n / float(1 << 53))).astype(np.int64), n - 1)
    uniq, first = np.unique(cand, return_index=True)
    assert uniq.size >= k, "draw more candidates"
    return np.sort(cand[np.sort(first)[:k]]).astype(np.uint32)


def bf16_bits(x):
    """Round to nearest even from float32; float64 first rounded to odd into float32."""
    if x.dtype == np.float64:
        y = x.astype(np.float32)
        bits = y.view(np.uint32)
        with np.errstate(invalid="ignore"):
            bits[np.abs(y.astype(np.float64)) > np.abs(x)] -= np.uint32(1)
            inexact = (y.astype(np.float64) != x) & ~np.isnan(x)
        bits[inexact] |= np.uint32(1)
        x = y
    u = x.view(np.uint32)
    out = ((u + ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def dither_levels(v, levels, natural, norm, seed64):
    """Unsigned levels q = level + s by stochastic rounding, in v's dtype."""
    dt = v.dtype.type
    a = np.abs(v)
    if not norm > 0 or not math.isfinite(norm):
        return np.full(v.size, levels, dtype=np.uint16)
    words = np.random.PCG64(seed64).random_raw((v.size + 1) // 2).astype("<u8").view("<u4")[:v.size]
    u = (words >> np.uint32(8)).astype(v.dtype) * dt(1.0 / (1 << 24))
    if natural:
        p = a / dt(norm)
        e = np.maximum(np.frexp(p)[1].astype(np.int32) - 1, -levels)
        small = (e < 1 - levels) | (p == 0)
        lo_val = np.where(small, dt(0), np.ldexp(dt(1), e))
        step = np.where(small, np.ldexp(dt(1), 1 - levels), lo_val)
        with np.errstate(divide="ignore", invalid="ignore"):
            lv = np.where(small, 0, e + levels) + (u < (p - lo_val) / step)
        lv[p == 0] = 0
    else:
        sp = a * dt(levels / norm)
        lv = np.floor(sp)
        lv = lv + (u < sp - lv)
    lv = np.minimum(lv, levels).astype(v.dtype)
    return np.where(v < 0, -lv, lv).astype(v.dtype) + dt(levels)


def pack_levels(q, levels):
    bits = level_bits(levels)
    q = q.astype(np.uint16)
    if bits == 16:
        return q.astype("<u2").tobytes()
    per = 8 // bits
    q8 = np.concatenate([q.astype(np.uint8), np.zeros(-q.size % per, np.uint8)]).reshape(-1, per)
    shifts = np.array([8 - bits * (j + 1) for j in range(per)], np.uint8)
    return np.bitwise_or.reduce(q8 << shifts, axis=1).astype(np.uint8).tobytes()


def encode(method, v, flags, k=0, levels=0, seed=0, dither_seed=None, scale=None):
    """The blob of v. ``scale``: onebit's scale or dithering's norm (see the module docstring)."""
    n, dtype = v.size, 0 if v.dtype == np.float32 else 1
    if method == FP16:
        with np.errstate(over="ignore"):
            return header(FP16, dtype, flags, n) + v.astype(np.float16).tobytes()
    if method == BF16:
        return header(BF16, dtype, flags, n) + bf16_bits(v).tobytes()
    if method == ONEBIT:
        return header(ONEBIT, dtype, flags, n) + struct.pack("<d", scale) + np.packbits(v < 0).tobytes()
    if method == TOPK:
        mag = np.abs(v)
        order = np.lexsort((np.arange(n), -np.where(np.isnan(mag), np.inf, mag)))  # ties: lower index
        idx = np.sort(order[:k]).astype(np.uint32)
        return header(TOPK, dtype, flags, n, k=k) + idx.tobytes() + v[idx].tobytes()
    if method == SPARSE:
        idx = np.flatnonzero(v).astype(np.uint32)
        return header(SPARSE, dtype, flags, n, k=idx.size) + idx.tobytes() + v[idx].tobytes()
    if method == RANDOMK:
        return header(RANDOMK, dtype, flags, n, k=k, seed=seed) + v[random_indices(seed, n, k)].tobytes()
    if method == DITHERING:
        q = dither_levels(v, levels, flags & F_NATURAL, scale, dither_seed)
        norm = scale if not math.isfinite(scale) or scale > 0 else 0.0
        return (header(DITHERING, dtype, flags, n, seed=seed, levels=levels) + struct.pack("<d", norm)
                + pack_levels(q, levels))
    raise AssertionError(method)


def decode(blob, out=None):
    """The values of a blob (added into ``out`` when given)."""
    _, _, method, dtype, flags, levels, n, k, seed = HEADER.unpack(blob[:32])
    dt, p = NP[dtype], np.frombuffer(blob, np.uint8)[32:]
    if method in (TOPK, SPARSE, RANDOMK):
        if method == RANDOMK:
            idx, vals = random_indices(seed, n, k), p.view(dt)
        else:
            idx, vals = p[:4 * k].view(np.uint32), p[4 * k:].view(dt)
        dense = np.zeros(n, dt)
        dense[idx] = vals
        if out is not None:
            with np.errstate(over="ignore"):
                out[idx] += vals
            return out
        return dense
    if method == FP16:
        vals = p.view(np.float16).astype(dt)
    elif method == BF16:
        vals = (p.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(dt)
    elif method == ONEBIT:
        s = dt.type(struct.unpack("<d", p[:8].tobytes())[0])
        vals = np.where(np.unpackbits(p[8:])[:n].astype(bool), -s, s).astype(dt)
    elif method == DITHERING:
        norm = struct.unpack("<d", p[:8].tobytes())[0]
        bits = level_bits(levels)
        if bits == 16:
            q = p[8:].view("<u2").astype(np.int64)
        else:
            fields = np.unpackbits(p[8:]).reshape(-1, bits)
            q = (fields.astype(np.int64) << np.arange(bits - 1, -1, -1)).sum(axis=1)[:n]
        mag = np.abs(q - levels)
        unit = np.where(mag > 0, np.ldexp(1.0, mag - levels), 0.0) if flags & F_NATURAL else mag / float(levels)
        with np.errstate(invalid="ignore"):
            vals = (np.sign(q - levels) * unit * norm).astype(dt)
    else:
        raise AssertionError(method)
    if out is not None:
        with np.errstate(over="ignore"):
            out += vals
        return out
    return vals
