"""The compressor interface shared by the framework plugins (BytePS/Horovod ``Compression``).

A compressor changes what crosses the network: ``compress`` runs before push_pull and
``decompress`` after. Plugins add their framework's casts (e.g. ``FP16Compressor``).
"""


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
