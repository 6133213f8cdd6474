"""BytePS's ``byteps.torch.parallel``: :class:`DistributedDataParallel` (distributed.py)."""
from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
