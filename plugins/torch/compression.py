"""Gradient compressors (BytePS/Horovod ``Compression``): ``none`` and ``fp16`` are Horovod's, applied
to the tensor before push_pull and undone after; the others are wire codecs (byteps/compression.py),
which encode each partition only while it crosses the network (docs/compression.md).
``DistributedOptimizer(compression=...)`` also takes a dict ``{parameter name or fnmatch pattern:
compressor}`` (unmatched parameters: ``Compression.none``)."""
import fnmatch

import torch

from byteps.compression import Compressor, NoneCompressor, WireCompressions, WireCompressor, wire_codec


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (halves the bytes on the wire).

    The server adds each push in fp32 and rounds the running sum to fp16 after every addition.
    """

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression(WireCompressions):
    """Available compressors.

    * ``none``, ``fp16``: Horovod's tensor compressors.
    * ``wire(method, **options)``: any wire codec; the named ones below are its defaults.
    * ``bf16``: bfloat16 on the wire (the sum is recast); ``wire("fp16")`` is the fp16 equivalent.
    * ``onebit``: signs and one scale (mean |x|), ~32x smaller for float32.
    * ``topk``: the k largest magnitudes of each partition (``k``/``ratio``; default 1%).
    * ``randomk``: k elements at indices drawn from a seed every worker shares (default 1%).
    * ``dithering``: stochastic quantisation (``levels``, ``partition``, ``normalize``).

    Wire codec options: ``error_feedback``, ``momentum`` (momentum correction, mu), ``seed``,
    ``min_bytes`` (default BYTEPS_MIN_COMPRESS_BYTES); docs/compression.md.
    """

    fp16 = FP16Compressor


def select(compression, name):
    """The compressor for tensor ``name``: ``compression`` itself, or from a per-tensor dict
    (exact name first, then the first matching fnmatch pattern; Compression.none otherwise)."""
    if not isinstance(compression, dict):
        return compression
    if name in compression:
        return compression[name]
    return next((comp for pattern, comp in compression.items() if fnmatch.fnmatchcase(name, pattern)), NoneCompressor)


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor", "WireCompressor", "select", "wire_codec"]
