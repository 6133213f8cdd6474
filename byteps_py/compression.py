"""Gradient compression: Horovod-style tensor compressors and BytePS-style wire codecs.

* **Tensor compressors** (:class:`Compressor`, :class:`NoneCompressor`; the plugins add
  ``FP16Compressor``): ``compress(tensor) -> (tensor, ctx)`` runs before push_pull and
  ``decompress`` after, so the whole push_pull, server sum included, sees the compressed tensor.
* **Wire codecs** (:class:`WireCompressor`): the worker's native core encodes each partition just
  before it crosses the network to a server on another machine; the server decodes, sums in the
  tensor's dtype and answers with the re-encoded sum where the method allows. Their tensor
  compressor interface is the identity, so the plugins accept them wherever they accept
  ``Compression.none``.

The codecs are C++ (``core/kernels/bps_codecs.h``, wrapped by ``byteps.core._reduce``); this module
is their Python API. Methods, options, the 32-byte blob header and exactness: docs/compression.md.
"""
import collections
import os

import numpy as np

from . import config
from .errors import CodecError, ConfigError
from .core import _reduce

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

HEADER_SIZE = 32  # the blob header (docs/compression.md, "Wire format")

FP16, BF16, ONEBIT, TOPK, RANDOMK, DITHERING, SPARSE = range(1, 8)
#: method name -> id (SPARSE is only ever produced by a server)
METHODS = {"fp16": FP16, "bf16": BF16, "onebit": ONEBIT, "topk": TOPK, "randomk": RANDOMK, "dithering": DITHERING}
NAMES = {v: k for k, v in METHODS.items()}
NAMES[SPARSE] = "sparse"

F_EF, F_SCALING, F_NATURAL, F_L2 = 1, 2, 4, 8

_F32, _F64 = 0, 1  # byteps.core.dtypes codes (kept local: this module is imported by byteps.common)
_NP = {_F32: np.dtype(np.float32), _F64: np.dtype(np.float64)}
_MAX_COUNT = 1 << 32  # indices travel as uint32


#: a parsed blob: its header fields, and the blob itself (any buffer)
Info = collections.namedtuple("Info", "method dtype flags levels n k seed blob")


def payload_size(method, n, itemsize, k=0, levels=0):
    """Exact payload bytes of a blob (the header excluded)."""
    if method not in NAMES:
        raise CodecError(f"unknown compression method {method}")
    return _reduce.codec_payload_size(method, n, itemsize, k, levels)


def parse(buf):
    """Parse and validate a blob (any buffer); raise :class:`CodecError` on anything malformed."""
    return Info(*_reduce.codec_parse(buf), buf)


# --------------------------------------------------------------------------- random streams


def derive_seed(seed, key, rnd, stream=None):
    """64-bit seed of one message's random stream, from (seed, wire key, round[, stream]):
    numpy's SeedSequence of their 32-bit words, low word first."""
    return _reduce.codec_derive_seed(seed, key, rnd, stream)


def random_indices(seed64, n, k):
    """k distinct indices in [0, n), sorted (uint32), from PCG64(seed64): identical on every process.

    Candidates floor((r >> 11) * n / 2**53) of the raw outputs r are drawn in order and the first
    k distinct ones kept.
    """
    return _reduce.codec_random_indices(seed64, n, k)


# --------------------------------------------------------------------------- encode, decode, recompress


def decode_into(info, out, accumulate=False):
    """Write (or, with ``accumulate``, add) the decoded values of ``info`` into typed array ``out``."""
    if out.size != info.n or out.dtype != _NP[info.dtype]:
        raise CodecError(f"{NAMES[info.method]} body decodes to {info.n} {_NP[info.dtype].name} values, "
                         f"the destination holds {out.size} {out.dtype.name}")
    _reduce.codec_decode_into(info.blob, out, accumulate)
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
    keeps = bool(info.flags & F_EF) and info.method not in (TOPK, SPARSE, RANDOMK)
    valid = keeps and residual is not None and residual.size == total.size and residual.dtype == total.dtype
    if keeps and not valid:
        residual = np.empty(total.size, total.dtype)
    blob = _reduce.codec_recompress(info.blob, total, key, rnd, stream, residual if keeps else None, valid)
    return blob, (residual if keeps else None)


# --------------------------------------------------------------------------- the compressor object


class _State:
    """A wire key's momentum and error-feedback residual (updated in place by the kernels)."""

    __slots__ = ("n", "dtype", "residual", "has_residual", "momentum")

    def __init__(self, n, dtype):
        self.n, self.dtype = n, dtype
        self.residual = self.momentum = None
        self.has_residual = False  # the first round has nothing to add yet


class WireCompressor(NoneCompressor):
    """A wire codec: a method with its options, and the worker's per-partition state.

    ``compress``/``decompress`` (the tensor compressor interface) are the identity. A push_pull's
    partitions are encoded by the worker's native core (core/pipeline/worker_codec.h), with the
    same kernels and this object's options, keeping each partition's error-feedback residual and
    momentum per tensor and codec setting; :meth:`encode` is the same encoding from Python, with
    the state kept per wire key in the object (the engine uses it only for a joined process's local
    reduce). Either state restarts when a key starts again at round 0 (a new ``init()`` or
    ``join()``). Calling the object returns a copy with some options changed
    (``Compression.topk(k=0.001)``).

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
        return _reduce.codec_k_for(self.k, n) if self.method_id in (TOPK, RANDOMK) else 0

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
        n = data.size // _NP[dtype].itemsize
        st = self._state.get(key)
        if st is None or rnd == 0 or st.n != n or st.dtype != dtype:
            st = self._state[key] = _State(n, dtype)
        if self.momentum and st.momentum is None:
            st.momentum = np.zeros(n, dtype=_NP[dtype])
        if self.error_feedback and st.residual is None:
            st.residual = np.empty(n, dtype=_NP[dtype])
        seed = derive_seed(self.seed, key, rnd) if self.method_id == RANDOMK else self.seed
        dither_seed = derive_seed(self.seed, key, rnd, stream) if self.method_id == DITHERING else 0
        blob = _reduce.codec_compress(self.method_id, dtype, self.flags, self.levels, self._count(n), seed,
                                      dither_seed, data, st.momentum, self.momentum, self.nesterov, st.residual,
                                      st.has_residual)
        st.has_residual = self.error_feedback
        return blob

    def residual(self, key):
        """The error-feedback residual of a wire key (a copy), or None."""
        st = self._state.get(key)
        return None if st is None or not st.has_residual else st.residual.copy()


# --------------------------------------------------------------------------- selection and configuration

#: environment variables read here (also in byteps.config.VARIABLES and docs/env.md)
ENV_VARIABLES = ("BYTEPS_COMPRESSOR", "BYTEPS_COMPRESSOR_K", "BYTEPS_ERROR_FEEDBACK", "BYTEPS_MOMENTUM_MU",
                 "BYTEPS_COMPRESSOR_SEED", "BYTEPS_MIN_COMPRESS_BYTES")
DEFAULT_MIN_BYTES = 65536


def min_compress_bytes(env=None):
    env = os.environ if env is None else env
    return config._int(env, "BYTEPS_MIN_COMPRESS_BYTES", DEFAULT_MIN_BYTES, minimum=0)


def _number(env, name, default=None):
    raw = config._get(env, name, default)
    try:
        return None if raw is None else float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def _k_option(method, k):
    """BytePS's one ``k`` setting as an option: dithering's levels, else topk/randomk's k."""
    return {"levels": int(k)} if method == "dithering" else {"k": float(k)}


def from_env(env=None):
    """The job-wide wire compressor configured by BYTEPS_COMPRESSOR & co., or None; ConfigError if malformed."""
    env = os.environ if env is None else env
    method = (config._get(env, "BYTEPS_COMPRESSOR", "none")).lower()
    if method in ("none", "0", "off"):
        return None
    if method not in METHODS:
        raise ConfigError(f"BYTEPS_COMPRESSOR={method!r} must be one of none, {', '.join(METHODS)}")
    k = _number(env, "BYTEPS_COMPRESSOR_K")
    kwargs = dict(seed=config._int(env, "BYTEPS_COMPRESSOR_SEED", 0, minimum=0),
                  error_feedback=config._bool(env, "BYTEPS_ERROR_FEEDBACK"),
                  momentum=_number(env, "BYTEPS_MOMENTUM_MU", "0"), min_bytes=min_compress_bytes(env))
    if k is not None:
        kwargs.update(_k_option(method, k))
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
        kwargs.update(_k_option(method, params["k"]))
    kwargs.update({key: params[key] for key in ("partition", "normalize", "min_bytes") if key in params})
    if "scaling" in params:
        kwargs["scaling"] = str(params["scaling"]).lower() not in ("0", "false", "no")
    return WireCompressor(method, **kwargs)
