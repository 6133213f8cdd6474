"""The CPUs a worker process may use, and binding a machine's worker processes to them when they
outnumber them (BYTEPS_CPU_BIND).

Why bind: a synchronous call of one small tensor polls for its answer for a while before it sleeps
(BYTEPS_SPIN_US), because waking a sleeping process costs more than the call. A process that polls
looks busy to the kernel's load balancer, so when a machine's worker processes outnumber its CPUs
the balancer can leave three of them on one CPU and the poller alone on the other, and keep it so:
on the 2-core VM, 4 processes then took 75-140 us a 4 KB call where an even split took 37-64 us
(docs/benchmarks.md, "Shared-memory local links"). Binding local rank r to the r-th usable CPU
(round robin) gives every CPU the same number of processes. Threads and processes started later
inherit the binding, which is why it is applied only where the processes outnumber the CPUs anyway.
"""
import os

from .log import logger

_before_binding = None  # the CPUs this process could use before bind_worker() narrowed them


def usable_cpus():
    """The CPUs this process may run on (as before bind_worker(), if it bound us)."""
    return set(_before_binding) if _before_binding is not None else os.sched_getaffinity(0)


def bind_worker(local_rank, local_size, mode):
    """Bind every thread of this worker process to one CPU: local rank r to the r-th usable CPU.

    ``mode`` is BYTEPS_CPU_BIND: "auto" binds only where the machine's ``local_size`` worker processes
    outnumber the usable CPUs, "1" always, "0" never. Returns the CPU, or None when not bound."""
    global _before_binding
    cpus = sorted(usable_cpus())
    if mode == "0" or (mode == "auto" and local_size <= len(cpus)):
        return None
    cpu = cpus[local_rank % len(cpus)]
    if _before_binding is None:
        _before_binding = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that ended meanwhile
            pass
    logger.info("local rank %d of %d bound to CPU %d (%d usable CPUs; BYTEPS_CPU_BIND=%s)", local_rank,
                local_size, cpu, len(cpus), mode)
    return cpu
