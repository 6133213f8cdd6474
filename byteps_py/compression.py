"""Gradient compression: Horovod-style tensor compressors and BytePS-style wire codecs.

Two layers, as in BytePS (https://github.com/bytedance/byteps: Horovod-style compressors in its framework
plugins, and the wire compressors of byteps/common/compressor run by workers and servers):

* **Tensor compressors** (:class:`Compressor`, :class:`NoneCompressor`; the plugins add
  ``FP16Compressor``): ``compress(tensor) -> (tensor, ctx)`` runs before push_pull and
  ``decompress`` after, so the whole push_pull, server sum included, sees the compressed tensor.
* **Wire codecs** (:class:`WireCompressor`): the engine encodes each partition just before it
  crosses the network to a server on another machine, the server decodes every push into the
  key's store (which stays in the tensor's dtype), sums, and answers workers that pushed
  compressed with the re-encoded sum where the method allows. Traffic to a server on the same
  machine goes through shared memory and is never compressed. The tensor compressor interface of
  a :class:`WireCompressor` is the identity, so the plugins accept it wherever they accept
  ``Compression.none``.

Methods (``method``; compressed size for a float32 partition of n elements):

=========== ======================================================= ============== ==================
method      what is sent                                            size           pull (reply)
=========== ======================================================= ============== ==================
fp16        the values cast to IEEE half (round to nearest even)     2n             the sum, recast
bf16        the values cast to bfloat16 (round to nearest even)      2n             the sum, recast
onebit      the signs (np.packbits) and one scale, mean |x|          n/8 + 8        the sum, recompressed
topk        the k largest |x|: uint32 indices + values               8k             the sum on the union of
                                                                                    pushed indices (sparse;
                                                                                    exact), or raw if larger
randomk     values at k indices drawn from (seed, key, round): the   4k             the sum at the same k
            same on every worker, so no indices travel                              indices (exact)
dithering   stochastic quantisation to ``levels`` levels of |x|/norm b*n/8 + 8,     the sum, requantised
            (linear or natural, norm max or l2), b bits per element  b in 2, 4, 8,
                                                                     16: holds
                                                                     2*levels + 1
=========== ======================================================= ============== ==================

The random streams (randomk's indices; dithering's draws, which also depend on the sender so that
workers draw independently) are PCG64 seeded through SeedSequence with (seed, wire key, round).

Options of every method: ``error_feedback`` (the worker keeps, per partition, what compression
lost -- ``residual = (input + residual) - decode(encode(input + residual))``, computed in the
tensor's dtype -- and adds it to the next round's input; the server then keeps a residual for the
recompressed pull as well, as BytePS does), ``momentum`` (momentum correction on the worker, as
in BytePS / DGC: ``m = mu * m + g`` and ``m`` is compressed; use it with a plain SGD optimizer;
``nesterov=True`` sends ``g + mu * m``), ``seed`` (random methods: runs are reproducible and
randomk's indices agree on every worker), ``min_bytes`` (tensors smaller than this are sent raw; default
``BYTEPS_MIN_COMPRESS_BYTES``). Only float32 and float64 tensors are compressed; a partition whose
encoding would not be smaller than its raw bytes is sent raw.

Wire format of one compressed partition: a 32-byte little-endian header, then the payload.

====== ====== ==============================================================
offset type   field
====== ====== ==============================================================
0      2s     magic ``b"CZ"``
2      u8     codec version (1)
3      u8     method id (:data:`METHODS`; 7 = sparse, a server's topk reply)
4      u8     dtype code of the decoded values (float32 0, float64 1)
5      u8     flags: 1 error feedback, 2 onebit scaling, 4 natural dithering, 8 l2 norm
6      u16    dithering levels
8      u64    element count n of the dense partition
16     u64    k: elements sent (topk, randomk, sparse)
24     u64    seed: randomk's derived index seed; dithering's configured seed
====== ====== ==============================================================

The frame header's ``length`` stays the dense byte count (wire.FLAG_COMPRESSED marks the body as
this blob), so the server's checks that every push of a round has the same length and dtype, and
the store's allocation, are unchanged; :func:`parse` checks that the blob's own size matches its
header exactly and that n * itemsize equals that length. Every push of a round must use the same
compression (the server compares the header fields and fails the round naming the ranks).

Every kernel is vectorised numpy (no Python per element); the random streams come from PCG64
raw output seeded through SeedSequence, both stable across numpy versions, not from
``Generator`` methods (whose algorithms may change), so workers with different numpy versions
agree.
"""
import collections
import math
import os
import struct

import numpy as np

from .errors import ConfigError, ProtocolError

# --------------------------------------------------------------------------- tensor compressors


class Compressor:
    """Interface: compress(tensor) -> (tensor, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


# --------------------------------------------------------------------------- wire format

MAGIC = b"CZ"
VERSION = 1
HEADER = struct.Struct("<2sBBBBHQQQ")
HEADER_SIZE = HEADER.size  # 32

FP16, BF16, ONEBIT, TOPK, RANDOMK, DITHERING, SPARSE = range(1, 8)
#: method name -> id (SPARSE is only ever produced by a server)
METHODS = {"fp16": FP16, "bf16": BF16, "onebit": ONEBIT, "topk": TOPK, "randomk": RANDOMK, "dithering": DITHERING}
NAMES = {v: k for k, v in METHODS.items()}
NAMES[SPARSE] = "sparse"

F_EF, F_SCALING, F_NATURAL, F_L2 = 1, 2, 4, 8

_F32, _F64 = 0, 1  # byteps.core.dtypes codes (kept local: this module is imported by byteps.common)
_NP = {_F32: np.dtype(np.float32), _F64: np.dtype(np.float64)}
_MAX_COUNT = 1 << 32  # indices travel as uint32


class CodecError(ProtocolError):
    """A compressed body that cannot be decoded (bad header, wrong size, indices out of range)."""


class Info:
    """A parsed blob: header fields and the payload (a read-only uint8 array)."""

    __slots__ = ("method", "dtype", "flags", "levels", "n", "k", "seed", "payload")

    @property
    def itemsize(self):
        return _NP[self.dtype].itemsize

    @property
    def nbytes(self):
        """Bytes of the dense partition this blob decodes to."""
        return self.n * self.itemsize

    def identity(self):
        """What every push of one round must agree on (n is checked through the frame's length)."""
        return (self.method, self.dtype, self.flags, self.levels, self.k, self.seed)

    def describe(self):
        return describe(self)


def describe(info):
    """Human-readable compression of a push, for error messages (None: sent uncompressed)."""
    if info is None:
        return "no compression"
    name = NAMES.get(info.method, f"method {info.method}")
    opts = []
    if info.method in (TOPK, RANDOMK, SPARSE):
        opts.append(f"k={info.k} of {info.n}")
    if info.method == RANDOMK:
        opts.append(f"index seed {info.seed:#x}")
    if info.method == ONEBIT:
        opts.append("scaling" if info.flags & F_SCALING else "no scaling")
    if info.method == DITHERING:
        opts += [f"levels={info.levels}", "natural" if info.flags & F_NATURAL else "linear",
                 "l2" if info.flags & F_L2 else "max", f"seed={info.seed}"]
    if info.flags & F_EF:
        opts.append("error feedback")
    return f"{name}({', '.join(opts)})"


def _pack_header(method, dtype, flags, n, k=0, seed=0, levels=0):
    return HEADER.pack(MAGIC, VERSION, method, dtype, flags, levels, n, k, seed)


def _level_bits(levels):
    """Bits per element of dithering: levels -s..s stored as 0..2s in the smallest of 2, 4, 8 or 16
    bits that holds them (powers of two pack with a few vectorised shifts)."""
    need = (2 * levels).bit_length()
    return next(b for b in (2, 4, 8, 16) if b >= need)


def payload_size(method, n, itemsize, k=0, levels=0):
    """Exact payload bytes of a blob (the header excluded)."""
    if method in (FP16, BF16):
        return 2 * n
    if method == ONEBIT:
        return 8 + (n + 7) // 8
    if method in (TOPK, SPARSE):
        return k * (4 + itemsize)
    if method == RANDOMK:
        return k * itemsize
    if method == DITHERING:
        return 8 + (n * _level_bits(levels) + 7) // 8
    raise CodecError(f"unknown compression method {method}")


def parse(buf):
    """Parse and validate a blob (any buffer); raise :class:`CodecError` on anything malformed."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size < HEADER_SIZE:
        raise CodecError(f"compressed body of {raw.size} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, method, dtype, flags, levels, n, k, seed = HEADER.unpack(raw[:HEADER_SIZE].tobytes())
    if magic != MAGIC:
        raise CodecError(f"bad compression magic {magic!r}")
    if version != VERSION:
        raise CodecError(f"compression version {version} is not supported (this build speaks {VERSION})")
    if method not in NAMES:
        raise CodecError(f"unknown compression method {method}")
    if dtype not in _NP:
        raise CodecError(f"compressed values of dtype code {dtype}; only float32 and float64 are compressed")
    if method in (TOPK, RANDOMK, SPARSE) and (k > n or n > _MAX_COUNT):
        raise CodecError(f"{NAMES[method]} sends k={k} of n={n} elements")
    if method == DITHERING and not 1 <= levels <= 0x7FFF:
        raise CodecError(f"dithering with {levels} levels")
    want = payload_size(method, n, _NP[dtype].itemsize, k, levels)
    if raw.size - HEADER_SIZE != want:
        raise CodecError(f"{NAMES[method]} body of n={n} elements should be {HEADER_SIZE + want} bytes, "
                         f"got {raw.size}")
    info = Info()
    info.method, info.dtype, info.flags, info.levels, info.n, info.k, info.seed = (method, dtype, flags, levels, n,
                                                                                   k, seed)
    info.payload = raw[HEADER_SIZE:]
    return info


# --------------------------------------------------------------------------- random streams

_MASK32 = 0xFFFFFFFF


def derive_seed(seed, key, rnd, stream=None):
    """64-bit seed of one message's random stream, from (seed, wire key, round[, stream]).

    SeedSequence's output is stable across numpy versions and platforms.
    """
    words = [seed & _MASK32, seed >> 32, key & _MASK32, key >> 32, rnd & _MASK32, rnd >> 32]
    if stream is not None:
        words.append(stream & _MASK32)
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])


_INDEX_CACHE = collections.OrderedDict()
_INDEX_CACHE_SIZE = 64


def random_indices(seed64, n, k):
    """k distinct indices in [0, n), sorted (uint32), from PCG64(seed64): identical on every process.

    Candidates floor(u * n) are drawn in order and the first k distinct ones kept. The number of
    draws that gives k distinct values in expectation, -n ln(1 - k/n), is drawn at once (then more
    if needed). Cached: a worker encodes and decodes, a server decodes every push and re-encodes,
    all with the same indices.
    """
    ck = (seed64, n, k)
    hit = _INDEX_CACHE.get(ck)
    if hit is not None:
        _INDEX_CACHE.move_to_end(ck)
        return hit
    if k >= n:
        idx = np.arange(n, dtype=np.uint32)
    else:
        bg = np.random.PCG64(seed64)
        draws = int(-n * math.log1p(-k / n) * 1.05) + 64
        cand = np.empty(0, dtype=np.int64)
        while True:
            raw = bg.random_raw(draws)
            more = ((raw >> np.uint64(11)).astype(np.float64) * (n / float(1 << 53))).astype(np.int64)
            cand = np.concatenate([cand, np.minimum(more, n - 1)])
            uniq, first = np.unique(cand, return_index=True)
            if uniq.size >= k:
                break
            draws = max(64, int(draws * 0.5))
        idx = np.sort(cand[np.sort(first)[:k]]).astype(np.uint32)
    idx.setflags(write=False)
    _INDEX_CACHE[ck] = idx
    if len(_INDEX_CACHE) > _INDEX_CACHE_SIZE:
        _INDEX_CACHE.popitem(last=False)
    return idx


# --------------------------------------------------------------------------- casts


def f32_to_bf16_bits(x):
    """float32 array -> bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bias = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    out = ((u + bias) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def f64_to_f32_round_to_odd(x):
    """float64 -> float32 rounded to odd (truncate, then set the last bit if inexact).

    Rounding to odd first and to nearest even second equals one rounding to nearest even when the
    intermediate format has at least 2 more bits (float32: 24 bits, bfloat16: 8), so float64 ->
    bfloat16 is correctly rounded without a double-rounding error.
    """
    y = x.astype(np.float32)
    bits = y.view(np.uint32)
    with np.errstate(invalid="ignore"):
        over = np.abs(y.astype(np.float64)) > np.abs(x)  # rounded away from zero: step back one ulp
    bits[over] -= np.uint32(1)
    with np.errstate(invalid="ignore"):
        inexact = y.astype(np.float64) != x
    inexact &= ~np.isnan(x)
    bits[inexact] |= np.uint32(1)
    return y


def to_bf16_bits(v):
    if v.dtype == np.float64:
        v = f64_to_f32_round_to_odd(v)
    return f32_to_bf16_bits(v)


def bf16_bits_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# --------------------------------------------------------------------------- encoders


def _k_for(k, n):
    """BytePS's compressor_k: below 1 a fraction of the elements, from 1 a count; at least 1."""
    if k < 1:
        return max(1, min(n, int(math.ceil(k * n))))
    return max(1, min(n, int(k)))


def _dither_levels(v, levels, natural, use_l2, seed64):
    """Levels of v as unsigned q = level + s in 0..2s (uint16), by stochastic rounding, and the norm.

    The computation runs in v's dtype; the draws are u = (w >> 8) / 2**24 for the 32-bit words w of
    PCG64's output, low word first. A non-finite input gives a non-finite norm: every value decodes
    to NaN.
    """
    dt = v.dtype.type
    a = np.abs(v)
    if use_l2:
        a64 = a.astype(np.float64)
        norm = float(np.sqrt(np.dot(a64, a64)))
    else:
        norm = float(a.max()) if a.size else 0.0
    if not norm > 0 or not math.isfinite(norm):  # all zeros (or non-finite input): nothing to quantise
        return np.full(v.size, levels, dtype=np.uint16), (norm if not math.isfinite(norm) else 0.0)
    # 32-bit words of PCG64's output, low word first: u = (word >> 8) / 2**24, exact in float32
    words = np.random.PCG64(seed64).random_raw((v.size + 1) // 2).astype("<u8", copy=False).view("<u4")[:v.size]
    u = (words >> np.uint32(8)).astype(v.dtype)
    u *= dt(1.0 / (1 << 24))
    if natural:  # levels 0, 2^(1-s), ..., 1/2, 1: index l > 0 stands for 2^(l - s)
        p = a / dt(norm)
        _, ex = np.frexp(p)  # p = m * 2^ex with m in [0.5, 1): floor(log2 p) = ex - 1
        e = np.maximum(ex.astype(np.int32) - 1, -levels)
        small = (e < 1 - levels) | (p == 0)  # below the smallest non-zero level: between 0 and 2^(1-s)
        lo_val = np.where(small, dt(0), np.ldexp(dt(1), e))
        step = np.where(small, np.ldexp(dt(1), 1 - levels), lo_val)  # next level - this level
        with np.errstate(divide="ignore", invalid="ignore"):  # step underflows to 0 only where p == 0
            lv = np.where(small, 0, e + levels) + (u < (p - lo_val) / step)
        lv[p == 0] = 0
    else:  # in place, in v's dtype: sp = |v| * s / norm; level = floor(sp) + (u < frac(sp))
        sp = np.multiply(a, dt(levels / norm), out=a)
        lv = np.floor(sp)
        sp -= lv
        lv += u < sp
    lv = np.minimum(lv, levels, out=lv if lv.dtype.kind == "f" else None)  # an l2 norm rounded below
    # max |x| must not give level s + 1; then signed level + s, as unsigned
    lv = lv.astype(v.dtype, copy=False)
    np.negative(lv, out=lv, where=v < 0)
    lv += dt(levels)
    return lv.astype(np.uint16), norm


def _dither_table(levels, natural, norm, dtype):
    """Value of every q in 0..2s: a lookup table, so decoding is one gather."""
    mag = np.abs(np.arange(-levels, levels + 1, dtype=np.int64))
    unit = np.where(mag > 0, np.ldexp(1.0, mag - levels), 0.0) if natural else mag / float(levels)
    return (np.sign(np.arange(-levels, levels + 1)) * unit * norm).astype(dtype)


def _pack_levels(q, levels):
    """q (uint16, 0..2s) as b-bit fields (b = :func:`_level_bits`, a power of two), first element in
    the most significant bits of each byte (b < 8), or as little-endian bytes (b = 8, 16)."""
    bits = _level_bits(levels)
    if bits == 16:
        return q.astype("<u2").tobytes()
    q8 = q.astype(np.uint8)
    per = 8 // bits  # fields per byte
    if per > 1:
        q8 = np.concatenate([q8, np.zeros(-q8.size % per, dtype=np.uint8)]).reshape(-1, per)
        out = q8[:, 0] << np.uint8(8 - bits)
        for j in range(1, per):
            out |= q8[:, j] << np.uint8(8 - bits * (j + 1))
        q8 = out
    return q8.tobytes()


def _unpack_levels(buf, n, levels):
    bits = _level_bits(levels)
    if bits == 16:
        return buf.view("<u2")
    per = 8 // bits
    if per == 1:
        return buf
    mask = np.uint8((1 << bits) - 1)
    q = np.empty((buf.size, per), dtype=np.uint8)
    for j in range(per):
        np.bitwise_and(buf >> np.uint8(8 - bits * (j + 1)), mask, out=q[:, j])
    return q.reshape(-1)[:n]


def _encode(method, v, dtype, flags, k=0, levels=0, seed=0, dither_seed=None):
    """The blob of typed array v (not modified)."""
    n = v.size
    if method == FP16:
        with np.errstate(over="ignore"):  # beyond 65504: inf, as any IEEE cast
            return _pack_header(FP16, dtype, flags, n) + v.astype(np.float16).tobytes()
    if method == BF16:
        return _pack_header(BF16, dtype, flags, n) + to_bf16_bits(v).tobytes()
    if method == ONEBIT:
        scale = float(np.abs(v).mean(dtype=np.float64)) if flags & F_SCALING and n else 1.0
        return (_pack_header(ONEBIT, dtype, flags, n) + struct.pack("<d", scale)
                + np.packbits(v < 0).tobytes())
    if method in (TOPK, SPARSE):
        if method == TOPK:
            idx = np.argpartition(np.abs(v), n - k)[n - k:] if k < n else np.arange(n)
            idx = np.sort(idx).astype(np.uint32)
        else:
            idx = np.flatnonzero(v).astype(np.uint32)
            k = idx.size
        return _pack_header(method, dtype, flags, n, k=k) + idx.tobytes() + v[idx].tobytes()
    if method == RANDOMK:
        idx = random_indices(seed, n, k)
        return _pack_header(RANDOMK, dtype, flags, n, k=k, seed=seed) + v[idx].tobytes()
    if method == DITHERING:
        q, norm = _dither_levels(v, levels, flags & F_NATURAL, flags & F_L2, dither_seed)
        return (_pack_header(DITHERING, dtype, flags, n, seed=seed, levels=levels) + struct.pack("<d", norm)
                + _pack_levels(q, levels))
    raise CodecError(f"unknown compression method {method}")


def decode_into(info, out, accumulate=False):
    """Write (or, with ``accumulate``, add) the decoded values of ``info`` into typed array ``out``."""
    if out.size != info.n or out.dtype != _NP[info.dtype]:
        raise CodecError(f"{NAMES[info.method]} body decodes to {info.n} {_NP[info.dtype].name} values, "
                         f"the destination holds {out.size} {out.dtype.name}")
    p, n, dt = info.payload, info.n, out.dtype
    if info.method in (TOPK, SPARSE, RANDOMK):
        if info.method == RANDOMK:
            idx = random_indices(info.seed, n, info.k)
            vals = p.view(dt)
        else:
            idx = p[:4 * info.k].view(np.uint32)
            vals = p[4 * info.k:].view(dt)
            # sorted and unique: fancy-index assignment would silently drop duplicates
            if info.k and (int(idx[-1]) >= n or (info.k > 1 and not bool(np.all(idx[1:] > idx[:-1])))):
                raise CodecError(f"{NAMES[info.method]} indices are not increasing within 0..{n - 1}")
        if accumulate:
            out[idx] += vals
        else:
            out.fill(0)
            out[idx] = vals
        return out
    if info.method == FP16:
        vals = p.view(np.float16)
    elif info.method == BF16:
        vals = bf16_bits_to_f32(p.view(np.uint16))
    elif info.method == ONEBIT:
        scale = dt.type(struct.unpack("<d", p[:8].tobytes())[0])
        # one gather: byte value -> its 8 decoded elements
        table = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1), -scale, scale)
        vals = table[p[8:]].reshape(-1)[:n]
    elif info.method == DITHERING:
        norm = struct.unpack("<d", p[:8].tobytes())[0]
        q = _unpack_levels(p[8:], n, info.levels)
        if int(q.max(initial=0)) > 2 * info.levels:
            raise CodecError(f"dithering level out of range 0..{2 * info.levels}")
        vals = _dither_table(info.levels, info.flags & F_NATURAL, norm, dt).take(q)
    else:
        raise CodecError(f"unknown compression method {info.method}")
    if accumulate:
        out += vals
    else:
        out[...] = vals
    return out


def decode(buf):
    """A blob's values as a new float32/float64 array."""
    info = parse(buf)
    return decode_into(info, np.empty(info.n, dtype=_NP[info.dtype]))


def recompress(info, total, key, rnd, stream, residual=None):
    """The server's reply to pushes compressed like ``info``: (blob or None for raw, residual).

    ``total`` is the typed sum. fp16/bf16, onebit and dithering re-encode it (with the server's
    own error feedback when the pushes use it); randomk takes the same indices, where the sum is
    exactly non-zero (no loss); topk sends the sum's non-zeros -- the union of the pushed indices
    -- as a sparse blob, exactly, unless that is not smaller than the raw sum (None: send raw).
    """
    n, itemsize = total.size, total.dtype.itemsize
    if info.method in (TOPK, SPARSE):
        nz = int(np.count_nonzero(total))
        if HEADER_SIZE + payload_size(SPARSE, n, itemsize, k=nz) >= n * itemsize:
            return None, None
        return _encode(SPARSE, total, info.dtype, info.flags & ~F_EF), None
    if info.method == RANDOMK:
        return _encode(RANDOMK, total, info.dtype, info.flags & ~F_EF, k=info.k, seed=info.seed), None
    v = total
    ef = bool(info.flags & F_EF)
    if ef and residual is not None and residual.size == n and residual.dtype == total.dtype:
        v = total + residual
    dseed = derive_seed(info.seed, key, rnd, stream) if info.method == DITHERING else None
    blob = _encode(info.method, v, info.dtype, info.flags, levels=info.levels, seed=info.seed, dither_seed=dseed)
    if ef:
        residual = v - decode_into(parse(blob), np.empty(n, dtype=total.dtype))
    return blob, (residual if ef else None)


# --------------------------------------------------------------------------- the compressor object


class _State:
    __slots__ = ("n", "dtype", "residual", "momentum")

    def __init__(self, n, dtype):
        self.n, self.dtype = n, dtype
        self.residual = self.momentum = None


class WireCompressor(Compressor):
    """A wire codec: a method with its options, and the worker's per-partition state.

    ``compress``/``decompress`` (the tensor compressor interface) are the identity; the engine
    calls :meth:`encode` per partition. Calling the object returns a copy with some options
    changed (``Compression.topk(k=0.001)``). Error-feedback residuals and momentum are kept per
    wire key (one per tensor partition) in the object, so keep using the same object for a
    tensor; they restart when a key starts again at round 0 (a new ``init()`` or ``join()``).

    Args:
        method: ``fp16``, ``bf16``, ``onebit``, ``topk``, ``randomk`` or ``dithering``.
        k: topk/randomk: elements sent per partition, a fraction of it if below 1 (BytePS's
            ``compressor_k``); default 0.01. For dithering, the same as ``levels``.
        ratio: alias of a fractional ``k``.
        levels: dithering levels s (1..32767); default 7 (4 bits per element: 8x smaller than float32).
        seed: random methods' seed; must be the same on every worker (default 0).
        error_feedback: keep what compression lost and add it to the next round's input.
        momentum: mu of momentum correction on the worker (0: off).
        nesterov: with momentum, send ``g + mu * m`` instead of ``m``.
        scaling: onebit: scale the signs by mean |x| (BytePS's ``compressor_onebit_scaling``);
            without, they decode to +-1.
        partition: dithering levels ``linear`` or ``natural`` (powers of two).
        normalize: dithering norm ``max`` or ``l2``.
        min_bytes: tensors smaller than this are sent raw (default BYTEPS_MIN_COMPRESS_BYTES, 65536).
    """

    def __init__(self, method, *, k=None, ratio=None, levels=None, seed=0, error_feedback=False, momentum=0.0,
                 nesterov=False, scaling=True, partition="linear", normalize="max", min_bytes=None):
        if method not in METHODS:
            raise ValueError(f"unknown compression method {method!r}; available: {', '.join(METHODS)}")
        self._kwargs = dict(k=k, ratio=ratio, levels=levels, seed=seed, error_feedback=error_feedback,
                            momentum=momentum, nesterov=nesterov, scaling=scaling, partition=partition,
                            normalize=normalize, min_bytes=min_bytes)
        self.method = method
        self.method_id = METHODS[method]
        if ratio is not None:
            if k is not None:
                raise ValueError("pass k or ratio, not both")
            if not 0 < ratio < 1:
                raise ValueError(f"ratio must be in (0, 1), got {ratio}")
            k = ratio
        if method == "dithering":
            if levels is not None and k is not None and levels != k:
                raise ValueError("dithering: pass levels (or k), not both")
            levels = int(levels if levels is not None else (k if k is not None else 7))
            if not 1 <= levels <= 0x7FFF:
                raise ValueError(f"dithering levels must be in 1..32767, got {levels}")
            k = None
        elif levels is not None:
            raise ValueError(f"levels is an option of dithering, not {method}")
        if method in ("topk", "randomk"):
            k = 0.01 if k is None else k
            if not (k > 0 and (k < 1 or float(k).is_integer())):
                raise ValueError(f"{method}: k must be a fraction in (0, 1) or a whole count >= 1, got {k}")
        elif k is not None:
            raise ValueError(f"k is an option of topk, randomk and dithering, not {method}")
        if partition not in ("linear", "natural"):
            raise ValueError(f"dithering partition must be 'linear' or 'natural', got {partition!r}")
        if normalize not in ("max", "l2"):
            raise ValueError(f"dithering normalize must be 'max' or 'l2', got {normalize!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum mu must be in [0, 1), got {momentum}")
        if not 0 <= int(seed) < 1 << 64:
            raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
        if min_bytes is not None and min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        self.k, self.levels, self.seed = k, levels or 0, int(seed)
        self.error_feedback, self.momentum, self.nesterov = bool(error_feedback), float(momentum), bool(nesterov)
        self.scaling, self.partition, self.normalize = bool(scaling), partition, normalize
        self._min_bytes = min_bytes
        self.flags = ((F_EF if self.error_feedback else 0) | (F_SCALING if method == "onebit" and self.scaling else 0)
                      | (F_NATURAL if method == "dithering" and partition == "natural" else 0)
                      | (F_L2 if method == "dithering" and normalize == "l2" else 0))
        self._state = {}  # wire key -> _State (engine thread only)

    # the tensor compressor interface: nothing happens to the tensor itself
    def compress(self, tensor):
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor

    def __call__(self, **overrides):
        kwargs = dict(self._kwargs)
        for a, b in (("k", "ratio"), ("k", "levels")):  # aliases: a new one replaces the old
            if a in overrides:
                kwargs[b] = None
            if b in overrides:
                kwargs[a] = None
        return WireCompressor(self.method, **{**kwargs, **overrides})

    def __repr__(self):
        opts = [f"{k}={v!r}" for k, v in self._kwargs.items()
                if v is not None and v != WireCompressor.__init__.__kwdefaults__.get(k)]
        return f"WireCompressor({self.method!r}{''.join(', ' + o for o in opts)})"

    @property
    def min_bytes(self):
        if self._min_bytes is None:
            self._min_bytes = min_compress_bytes()
        return self._min_bytes

    def _count(self, n):
        return _k_for(self.k, n) if self.method_id in (TOPK, RANDOMK) else 0

    def applies(self, dtype, tensor_nbytes, nbytes):
        """Whether a partition of ``nbytes`` of a tensor of ``tensor_nbytes`` (wire dtype code) is
        encoded: float32/float64, tensor at least min_bytes, and the blob smaller than the raw bytes.
        The same on every worker for the same tensor and options."""
        if dtype not in _NP or tensor_nbytes < self.min_bytes or nbytes == 0:
            return False
        itemsize = _NP[dtype].itemsize
        n = nbytes // itemsize
        if n >= _MAX_COUNT:
            return False
        size = HEADER_SIZE + payload_size(self.method_id, n, itemsize, self._count(n), self.levels)
        return size < nbytes

    def encode(self, data, dtype, key, rnd, stream=0):
        """The blob of one partition (``data``: its bytes as a uint8 array), applying momentum and
        error feedback with this wire key's state. ``stream`` (the worker's rank) keeps the
        workers' dithering draws independent."""
        v = data.view(_NP[dtype])
        n = v.size
        st = self._state.get(key)
        if st is None or rnd == 0 or st.n != n or st.dtype != dtype:
            st = self._state[key] = _State(n, dtype)
        if self.momentum:
            if st.momentum is None:
                st.momentum = np.zeros(n, dtype=v.dtype)
            m = st.momentum
            m *= v.dtype.type(self.momentum)
            m += v
            v = v + v.dtype.type(self.momentum) * m if self.nesterov else m
        if self.error_feedback and st.residual is not None:
            v = v + st.residual
        k = self._count(n)
        seed = self.seed
        if self.method_id == RANDOMK:
            seed = derive_seed(self.seed, key, rnd)
        dseed = derive_seed(self.seed, key, rnd, stream) if self.method_id == DITHERING else None
        blob = _encode(self.method_id, v, dtype, self.flags, k=k, levels=self.levels, seed=seed, dither_seed=dseed)
        if self.error_feedback:
            st.residual = v - decode_into(parse(blob), np.empty(n, dtype=v.dtype))
        return blob

    def residual(self, key):
        """The error-feedback residual of a wire key (a copy), or None."""
        st = self._state.get(key)
        return None if st is None or st.residual is None else st.residual.copy()


# --------------------------------------------------------------------------- selection and configuration

#: environment variables read here (also in byteps.config.VARIABLES and docs/env.md)
ENV_VARIABLES = ("BYTEPS_COMPRESSOR", "BYTEPS_COMPRESSOR_K", "BYTEPS_ERROR_FEEDBACK", "BYTEPS_MOMENTUM_MU",
                 "BYTEPS_COMPRESSOR_SEED", "BYTEPS_MIN_COMPRESS_BYTES")
DEFAULT_MIN_BYTES = 65536


def min_compress_bytes(env=None):
    from . import config

    env = os.environ if env is None else env
    return config._int(env, "BYTEPS_MIN_COMPRESS_BYTES", DEFAULT_MIN_BYTES, minimum=0)


def from_env(env=None):
    """The job-wide wire compressor configured by BYTEPS_COMPRESSOR & co., or None; ConfigError if malformed."""
    from . import config

    env = os.environ if env is None else env
    method = (config._get(env, "BYTEPS_COMPRESSOR", "none")).lower()
    if method in ("none", "0", "off"):
        return None
    if method not in METHODS:
        raise ConfigError(f"BYTEPS_COMPRESSOR={method!r} must be one of none, {', '.join(METHODS)}")
    raw_k = config._get(env, "BYTEPS_COMPRESSOR_K")
    k = None
    if raw_k is not None:
        try:
            k = float(raw_k)
        except ValueError:
            raise ConfigError(f"BYTEPS_COMPRESSOR_K={raw_k!r} is not a number") from None
    raw_mu = config._get(env, "BYTEPS_MOMENTUM_MU", "0")
    try:
        mu = float(raw_mu)
    except ValueError:
        raise ConfigError(f"BYTEPS_MOMENTUM_MU={raw_mu!r} is not a number") from None
    kwargs = dict(seed=config._int(env, "BYTEPS_COMPRESSOR_SEED", 0, minimum=0),
                  error_feedback=config._bool(env, "BYTEPS_ERROR_FEEDBACK"), momentum=mu,
                  min_bytes=min_compress_bytes(env))
    if k is not None:
        kwargs["levels" if method == "dithering" else "k"] = k if method != "dithering" else int(k)
    try:
        return WireCompressor(method, **kwargs)
    except ValueError as e:
        raise ConfigError(f"BYTEPS_COMPRESSOR={method}: {e} (BYTEPS_COMPRESSOR_K, BYTEPS_MOMENTUM_MU, "
                          "BYTEPS_COMPRESSOR_SEED; docs/env.md)") from None


_default = (None, None)  # (environment values, compressor): one object, so its state persists


def default_codec():
    """The job-wide wire compressor from the environment (one object per configuration)."""
    global _default
    values = tuple(os.environ.get(name) for name in ENV_VARIABLES)
    if _default[0] != values:
        _default = (values, from_env())
    return _default[1]


def resolve(compression):
    """The wire codec of a push_pull's ``compression`` argument.

    A :class:`WireCompressor` is used as is; ``False`` disables wire compression for this call;
    None or a tensor compressor (``Compression.none``/``fp16``) means the job-wide default
    (BYTEPS_COMPRESSOR, usually none).
    """
    if compression is False:
        return None
    if isinstance(compression, WireCompressor):
        return compression
    if compression is None or isinstance(compression, Compressor) or (
            isinstance(compression, type) and issubclass(compression, Compressor)):
        return default_codec()
    raise TypeError(f"compression must be a byteps compressor (e.g. Compression.onebit), None or False; "
                    f"got {compression!r}")


class WireCompressions:
    """The compressors every framework plugin offers (each plugin's ``Compression`` subclasses this
    and adds its tensor casts): ``none``, the wire codecs, and ``wire(method, **options)``."""

    none = NoneCompressor
    bf16 = WireCompressor("bf16")
    onebit = WireCompressor("onebit")
    topk = WireCompressor("topk")
    randomk = WireCompressor("randomk")
    dithering = WireCompressor("dithering")

    @staticmethod
    def wire(method, **options):
        return WireCompressor(method, **options)


def wire_codec(compression):
    """The :class:`WireCompressor` in ``compression`` or None (what plugins pass to push_pull)."""
    return compression if isinstance(compression, WireCompressor) else None


def from_params(params):
    """A :class:`WireCompressor` from BytePS MXNet's ``compression_params`` dict, or None.

    Keys (BytePS's names): ``compressor`` (onebit, topk, randomk, dithering, plus fp16/bf16),
    ``ef`` ("vanilla": error feedback), ``momentum`` ("nesterov" or "momentum"), ``momentum_mu``
    (default 0.9), ``k``, ``seed``, ``scaling`` (onebit), ``partition`` (linear/natural) and
    ``normalize`` (max/l2) for dithering, ``min_bytes``. BytePS's ``fp16`` key (cast before
    compressing) raises NotImplementedError; an unknown key ValueError.
    """
    if not params:
        return None
    params = dict(params)
    if "fp16" in params:  # BytePS's: cast to fp16 before compressing (use compressor "fp16" instead)
        raise NotImplementedError("compression_params: BytePS's 'fp16' option (cast, then compress) is not "
                                  "implemented; use {'compressor': 'fp16'} for fp16 on the wire")
    known = {"compressor", "ef", "momentum", "momentum_mu", "k", "seed", "scaling", "partition", "normalize",
             "min_bytes"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"compression_params: unsupported keys {unknown}; supported: {sorted(known)}")
    if "compressor" not in params:
        raise ValueError("compression_params needs 'compressor' (onebit, topk, randomk, dithering, fp16, bf16)")
    method = str(params["compressor"]).lower()
    ef = params.get("ef")
    if ef not in (None, "vanilla", "", False):
        raise ValueError(f"compression_params ef={ef!r}: only 'vanilla' error feedback exists")
    mom = params.get("momentum")
    if mom not in (None, "", False, "nesterov", "momentum"):
        raise ValueError(f"compression_params momentum={mom!r}: use 'nesterov' or 'momentum'")
    kwargs = dict(error_feedback=ef == "vanilla", seed=int(params.get("seed", 0)))
    if mom:
        kwargs.update(momentum=float(params.get("momentum_mu", 0.9)), nesterov=mom == "nesterov")
    if "k" in params:
        kwargs["levels" if method == "dithering" else "k"] = (int(params["k"]) if method == "dithering"
                                                              else float(params["k"]))
    for key in ("scaling", "partition", "normalize", "min_bytes"):
        if key in params:
            kwargs[key] = params[key]
    if "scaling" in kwargs:
        kwargs["scaling"] = str(kwargs["scaling"]).lower() not in ("0", "false", "no")
    return WireCompressor(method, **kwargs)
