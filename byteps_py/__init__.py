"""byteps: distributed-training communication in the BytePS design.

Framework plugins: ``import byteps.torch as bps``. This package imports no framework.
"""
import os as _os

from . import config
from .common import (barrier, init, is_initialized, join, local_rank, local_size, metrics, poll, rank, shutdown,
                     size, synchronize)
from .errors import (BytePSError, BytePSTimeoutError, ConfigError, NotInitializedError, PeerLostError,
                     ProtocolError, TensorMismatchError)

with open(_os.path.join(_os.path.dirname(__file__), "VERSION")) as _f:
    __version__ = _f.read().strip()

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "poll",
           "synchronize", "barrier", "join", "metrics", "config", "BytePSError", "BytePSTimeoutError", "ConfigError",
           "NotInitializedError", "PeerLostError", "ProtocolError", "TensorMismatchError", "__version__"]
