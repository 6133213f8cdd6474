"""The Summation Service: sums the partitions every worker pushes and answers the pulls.

Run it with ``python -m byteps.server`` (``bpslaunch`` does this for the server role).
"""
from .server import Server, main

__all__ = ["Server", "main"]
