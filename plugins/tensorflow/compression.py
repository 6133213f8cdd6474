"""Gradient compressors applied before push_pull and undone after (BytePS/Horovod ``Compression``)."""
import tensorflow as tf

from byteps.compression import Compressor, NoneCompressor


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


class Compression:
    """Available compressors: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
