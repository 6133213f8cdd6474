"""BytePS's elastic and telemetry calls: ``suspend()``, ``resume()`` and ``get_pushpull_speed()``
(docs/compat.md). byteps' tensor keys never depend on declaration order (the scheduler assigns them
by name), so ``suspend()`` is a collective ``shutdown()`` with nothing to keep for ``resume()``.
"""
import os
import threading
import time

from . import common

_lock = threading.Lock()
_last = None        # (monotonic time, total bytes) at the start of the current window
_speed = (0, -5.0)  # BytePS's "no data yet"


def suspend():
    """Leave the job (collective); :func:`resume` joins again."""
    global _last, _speed
    common.shutdown()
    with _lock:
        _last, _speed = None, (0, -5.0)


def resume(num_workers, num_servers, global_rank=None, context=None):
    """Join again after :func:`suspend`, with ``num_workers`` worker machines and ``num_servers`` servers
    (``global_rank`` sets BYTEPS_GLOBAL_RANK, which BytePS reads; byteps' scheduler assigns the ranks)."""
    os.environ["DMLC_NUM_WORKER"] = str(int(num_workers))
    os.environ["DMLC_NUM_SERVER"] = str(int(num_servers))
    if global_rank is not None:
        os.environ["BYTEPS_GLOBAL_RANK"] = str(int(global_rank))
    common.init()


def _total_bytes():
    counts = common.transport_bytes()
    return sum(counts["sent"].values()) + sum(counts["received"].values())


def get_pushpull_speed():
    """``(ms since the epoch, MB/s)`` of this worker's push_pull traffic (bytes sent to and received from the
    servers) over the last completed window of at least ``BYTEPS_SPEED_WINDOW`` seconds (default 10, as
    BytePS); ``(0, -5.0)`` until a first window has completed, as in BytePS."""
    global _last, _speed
    window = float(os.environ.get("BYTEPS_SPEED_WINDOW", "10"))
    now, total = time.monotonic(), _total_bytes()
    with _lock:
        if _last is None:
            _last = (now, total)
        elif now - _last[0] >= window:
            _speed = (int(time.time() * 1000), (total - _last[1]) / (now - _last[0]) / 1e6)
            _last = (now, total)
        return _speed
