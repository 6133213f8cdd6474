"""Native names for byteps's threads, so ``top -H``, ``ps -L``, ``py-spy`` and /proc tell them apart.

Python's thread names live only inside the interpreter; every OS thread of a worker is called
"python" unless it names itself (``prctl(PR_SET_NAME)``, at most 15 bytes). bench/bench_push_pull.py
``--overhead`` reads the per-thread CPU time under these names.
"""
import ctypes
import sys
import threading

_PR_SET_NAME = 15
_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def name_native():
    """Give the calling OS thread its Python thread's name (truncated to 15 bytes; Linux only)."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(threading.current_thread().name.encode()[:15]), 0, 0, 0)
