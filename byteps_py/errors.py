"""Exception types raised by byteps."""


class BytePSError(RuntimeError):
    """Base class of every byteps error (a RuntimeError, as Horovod users expect)."""


class ConfigError(BytePSError, ValueError):
    """A missing or malformed environment variable or argument."""


class NotInitializedError(BytePSError):
    """An API call made before ``init()`` or after ``shutdown()``."""


class TensorMismatchError(BytePSError, ValueError):
    """Workers disagree on a tensor's shape, dtype or root rank."""


class PeerLostError(BytePSError):
    """A peer (scheduler, server or worker) died or stopped answering."""


class BytePSTimeoutError(BytePSError, TimeoutError):
    """A blocking wait ran past its timeout; the message names who was waited for."""


class ProtocolError(BytePSError):
    """A malformed or unexpected message arrived on the wire."""


class UnsupportedTypeError(TypeError, ValueError):
    """A tensor dtype byteps cannot send (Horovod raises ValueError here, byteps TypeError: both match)."""


class CodecError(ProtocolError):
    """A compressed body that cannot be decoded (bad header, wrong size, indices out of range)."""
