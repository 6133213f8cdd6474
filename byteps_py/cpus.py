"""The CPUs a worker process may use, and binding the training threads of the job's worker processes
on a host to them where there are at least as many processes as CPUs (BYTEPS_CPU_BIND).

Only the training thread is bound (it is the one that polls, BYTEPS_SPIN_US): byteps' own threads,
started before, stay free to run on any CPU. Why, and what it measured: docs/env.md, BYTEPS_CPU_BIND.
The engine counts the worker processes that registered with this host's address (core/engine.py
_place_on_cpus).
"""
import os

from .log import logger

_before_binding = None  # the CPUs this process could use before bind_worker() narrowed them


def usable_cpus():
    """The CPUs this process may run on (as before bind_worker(), if it bound us)."""
    return set(_before_binding) if _before_binding is not None else os.sched_getaffinity(0)


def bind_worker(index, count, mode):
    """Bind the calling thread (the training thread) of this worker process, the ``index``-th of the
    job's ``count`` worker processes on this host, to one CPU: the ``index``-th usable one (round robin).

    ``mode`` is BYTEPS_CPU_BIND: "auto" binds only where ``count`` (2 or more) is at least the number
    of usable CPUs, "1" always, "0" never. Returns the CPU, or None when not bound."""
    global _before_binding
    cpus = sorted(usable_cpus())
    if mode == "0" or (mode == "auto" and (count < 2 or count < len(cpus))):
        return None
    cpu = cpus[index % len(cpus)]
    if _before_binding is None:
        _before_binding = set(cpus)
    os.sched_setaffinity(0, {cpu})  # 0: the calling thread (Linux)
    logger.info("the training thread of worker process %d of %d on this host bound to CPU %d (%d usable CPUs; "
                "BYTEPS_CPU_BIND=%s)", index, count, cpu, len(cpus), mode)
    return cpu
