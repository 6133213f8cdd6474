"""The CPUs a worker process may use, and binding the training threads of the job's worker processes
on a host to them where there are at least as many processes as CPUs (BYTEPS_CPU_BIND).

Why bind: a synchronous call of one small tensor polls for its answer for a while before it sleeps
(BYTEPS_SPIN_US), because waking a sleeping process costs more than the call. Processes that poll
look busy to the kernel's scheduler, and processes that wake each other tend to be woken on one
CPU; where the processes fill the host, the scheduler can then leave two pollers on one CPU (or
three of 4 on one of 2) and keep them so for seconds. On the 2-core VM a 4 KB call of 4 processes
took 75-80 us while three shared a CPU against 33-37 us bound (bench/call_cost.py --blocks), and
unbound pairs had blocks of 39-65 us against 10-16 us (docs/benchmarks.md, "Shared-memory local
links"). Binding the training thread (the one that called init(), which is the one that polls) of
the host's i-th worker process to the i-th usable CPU (round robin) gives every CPU the same number
of pollers. byteps' own threads, started before, stay free to run on any CPU: binding whole
processes made 64 MB push_pulls of 2 single-process machines 20-30% slower. Threads and processes
the training thread starts later (a DataLoader's workers) inherit the binding; that is why it
applies only where the host's worker processes fill its CPUs anyway.

The engine counts the worker processes that registered with this host's address (core/engine.py
_place_on_cpus): a machine's processes, or with ``bpslaunch --local`` every machine of the job.
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
