"""The byteps scheduler: rendezvous, ids, address book, barriers, tensor declarations, liveness.

Run it with ``python -m byteps.scheduler`` (``bpslaunch`` does this for the scheduler role).
It never sees gradient data.
"""
from .scheduler import Scheduler, main

__all__ = ["Scheduler", "main"]
