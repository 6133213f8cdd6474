"""Gradient compressors (BytePS/Horovod ``Compression``): ``none`` and ``fp16`` are Horovod's, applied to
the tensor before push_pull and undone after; the others are wire codecs (byteps/compression.py,
docs/compression.md), e.g. ``Compression.onebit(error_feedback=True)``."""
import tensorflow as tf

from byteps.compression import Compressor, NoneCompressor, WireCompressions, WireCompressor, wire_codec


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (halves the bytes on the wire).

    The server adds each push in fp32 and rounds the running sum to fp16 after every addition.
    """

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression(WireCompressions):
    """Available compressors: ``none``, ``fp16`` (Horovod's, on the tensor); wire codecs ``bf16``,
    ``onebit``, ``topk``, ``randomk``, ``dithering`` and ``wire(method, **options)`` (as in
    ``byteps.torch.Compression``)."""

    fp16 = FP16Compressor


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor", "WireCompressor", "wire_codec"]
