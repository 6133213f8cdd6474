"""Linux process controls for the children byteps starts (prctl through ctypes; no-ops elsewhere).

Used by bpslaunch (launcher.py) and by the services that rank 0 of a torchrun/mpirun job starts
(launch_env.py). A module of its own so that both can use it without importing each other.
"""
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


PRCTL = _libc_prctl()


def make_preexec():
    """A preexec_fn that makes the child get SIGTERM when its parent dies, even by SIGKILL.

    Not a new process group: Ctrl-C in a terminal still reaches each child directly, and PDEATHSIG
    also covers the parent being SIGKILLed. It fires when the *thread* that forked exits, so start
    children from the main thread. Only prctl and getppid run after fork (safe next to threads).
    """
    if PRCTL is None:
        return None
    parent = os.getpid()
    prctl = PRCTL

    def preexec():
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def become_subreaper():
    """Adopt orphaned descendants, so a grandchild whose parent already exited (a
    backgrounded `sleep`, a daemon) is still ours to kill at teardown."""
    if PRCTL is not None:
        PRCTL(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
