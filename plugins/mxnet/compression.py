"""Gradient compressors for byteps.mxnet: wire codecs (byteps/compression.py).

The tensor is left alone and each partition is encoded only while it crosses the network to a
server on another machine. Pass one as ``compression=`` to :func:`push_pull` /
``DistributedOptimizer``, or configure ``DistributedTrainer`` with BytePS's ``compression_params``
dict ({"compressor": "onebit", "ef": "vanilla", ...}). docs/compression.md.
"""
from byteps.compression import Compressor, NoneCompressor, WireCompressions, WireCompressor, from_params, wire_codec


class Compression(WireCompressions):
    """``none`` (the job's default, BYTEPS_COMPRESSOR) and the wire codecs ``bf16``, ``onebit``,
    ``topk``, ``randomk``, ``dithering``; ``wire(method, **options)`` for any (``wire("fp16")``)."""


__all__ = ["Compression", "Compressor", "NoneCompressor", "WireCompressor", "from_params", "wire_codec"]
