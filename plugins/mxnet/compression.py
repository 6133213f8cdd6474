"""Gradient compressors for byteps.mxnet: wire codecs (byteps/compression.py, docs/compression.md), for
``compression=`` of :func:`push_pull` / ``DistributedOptimizer``; ``DistributedTrainer`` takes
BytePS's ``compression_params`` dict ({"compressor": "onebit", "ef": "vanilla", ...})."""
from byteps.compression import Compressor, NoneCompressor, WireCompressions, WireCompressor, from_params, wire_codec


class Compression(WireCompressions):
    """``none`` (the job's default, BYTEPS_COMPRESSOR) and the wire codecs ``bf16``, ``onebit``,
    ``topk``, ``randomk``, ``dithering``; ``wire(method, **options)`` for any (``wire("fp16")``)."""


__all__ = ["Compression", "Compressor", "NoneCompressor", "WireCompressor", "from_params", "wire_codec"]
