"""The Summation Service: sums the partitions every worker pushes and answers the pulls.

Run it with ``python -m byteps.server`` (``bpslaunch`` does this for the server role). As in
BytePS, whose launcher runs ``python3 -c 'import byteps.server'`` for the server and scheduler
roles, importing this package from ``python -c`` with ``DMLC_ROLE=server`` (or ``scheduler``)
runs that service and exits with its status; any other import only defines the names below.
"""
import os
import sys

from .server import Server, main

__all__ = ["Server", "main"]


def _run_as_bytepses_launcher_does():
    """``python3 -c 'import byteps.server'`` with DMLC_ROLE=server/scheduler: BytePS's way to start one."""
    role = os.environ.get("DMLC_ROLE", "")
    if sys.argv[:1] != ["-c"] or role not in ("server", "scheduler") or os.environ.get("BYTEPS_SERVER_NO_RUN"):
        return
    os.environ["BYTEPS_SERVER_NO_RUN"] = "1"  # not again from a child that imports us
    if role == "scheduler":
        from byteps.scheduler import main as run
    else:
        run = main
    sys.exit(run())


_run_as_bytepses_launcher_does()
