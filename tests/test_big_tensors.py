"""Tensors over 2 GiB through real servers, summed exactly; peak memory measured.

Two workers push_pull one tensor of more than 2 GiB whose elements are small integers (so every
sum is exact) and compare the result with the locally computed sum, chunk by chunk
(tests/scenarios_stress.py::big_tensor); the test recomputes the expected sha256 itself.

* ``float32-shm``: 2.1 GiB of float32 in the default 4 MB partitions, two servers on this machine
  reached through shared memory (the default path of a colocated job).
* ``uint8-one-partition-tcp``: 2 GiB + 4 KiB of uint8 (more than 2^31 elements) sent as ONE
  partition over TCP to one server: every length on the way (wire header, ZeroMQ frames, the sum
  kernels, the worker's receive) is past 2^31. ZeroMQ's ``zmq_recv`` reports at most INT_MAX bytes,
  so the worker takes such a reply as a whole frame (core/engine.py, ``_receive``).

Memory: a sampler reads every process's resident set (and its kernel-recorded peak, VmHWM) and the
machine's MemAvailable every 0.2 s; the test prints them (docs/bad_input.md quotes them). The
machine this was written on has 24 GiB and 2 cores, so the cases run one after the other.
"""
import hashlib
import os
import sys
import threading
import time

import numpy as np
import psutil
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from scenarios_stress import big_values  # noqa: E402

GIB = 1 << 30
CASES = {
    "float32-shm": {"dtype": "float32", "numel": -(-int(2.1 * GIB) // 4), "servers": 2,
                    "env": {"BYTEPS_ENABLE_IPC": "1"}},
    "uint8-one-partition-tcp": {"dtype": "uint8", "numel": 2 * GIB + 4096, "servers": 1,
                                "env": {"BYTEPS_ENABLE_IPC": "0", "BYTEPS_PARTITION_BYTES": str(2 * GIB + 4096)}},
}
#: a server summing a 2 GiB partition, or a worker generating 2 GiB, is busy for seconds
SLOW_ENV = {"BYTEPS_TIMEOUT": "600", "BYTEPS_HEARTBEAT_TIMEOUT": "60", "BYTEPS_HEARTBEAT_INTERVAL": "1"}


def _mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm(pid):
    """The kernel's record of the process's peak resident set (VmHWM), in bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Sampler(threading.Thread):
    """Peak resident memory of named processes and of the machine, sampled until stopped."""

    def __init__(self, procs, period=0.2):
        super().__init__(daemon=True)
        self.procs = procs  # name -> pid
        self.period = period
        self.baseline = _mem_available()
        self.min_available = self.baseline
        self.peak_rss_sum = 0
        self.hwm = {name: 0 for name in procs}
        self._halt = threading.Event()

    def run(self):
        while not self._halt.wait(self.period):
            total = 0
            for name, pid in self.procs.items():
                hwm = _hwm(pid)
                if hwm is not None:
                    self.hwm[name] = max(self.hwm[name], hwm)
                try:
                    total += psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss_sum = max(self.peak_rss_sum, total)
            self.min_available = min(self.min_available, _mem_available())

    def stop(self):
        self._halt.set()
        self.join(5)

    def report(self):
        gib = lambda n: round(n / GIB, 2)  # noqa: E731
        return {"peak_rss_gib": {k: gib(v) for k, v in self.hwm.items()},
                "peak_sum_of_rss_gib": gib(self.peak_rss_sum),
                "peak_machine_use_gib": gib(self.baseline - self.min_available)}


def expected_sha256(dtype, numel, n):
    h = hashlib.sha256()
    chunk = 1 << 24
    for lo in range(0, numel, chunk):
        hi = min(numel, lo + chunk)
        want = big_values(0, lo, hi, dtype)
        for q in range(1, n):
            want = want + big_values(q, lo, hi, dtype)
        h.update(memoryview(np.ascontiguousarray(want.astype(dtype))))
    return h.hexdigest()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(CASES))
def test_push_pull_over_2gib(cluster, case):
    spec = CASES[case]
    nbytes = spec["numel"] * np.dtype(spec["dtype"]).itemsize
    assert nbytes > 2 * GIB
    need = 7 * nbytes  # the larger case's footprint, with room: see the printed measurements
    if _mem_available() < need:
        pytest.skip(f"needs about {need / GIB:.0f} GiB of free memory, {_mem_available() / GIB:.1f} available")
    c = cluster(2, spec["servers"], env={**SLOW_ENV, **spec["env"]})
    start = time.monotonic()
    c.run_workers("big_tensor", {"dtype": spec["dtype"], "numel": spec["numel"]})
    procs = {"scheduler": c.scheduler.pid, **{f"server{i}": p.pid for i, p in enumerate(c.servers)},
             **{f"worker{i}": p.pid for i, p in enumerate(c.workers)}}
    sampler = Sampler(procs)
    sampler.start()
    try:
        codes, scodes, sched = c.wait_all(1500)
    finally:
        sampler.stop()
    wall = time.monotonic() - start
    assert codes == [0, 0] and scodes == [0] * spec["servers"] and sched == 0, c.all_logs()
    res = c.results()
    for r in (0, 1):
        assert "value" in res[r], f"rank {r}: {res[r]}\n{c.all_logs()}"
    values = [res[r]["value"] for r in (0, 1)]
    report = {"case": case, "bytes": nbytes, "push_pull_s": [round(v["seconds"], 1) for v in values],
              "wall_s": round(wall, 1), **sampler.report()}
    print(report, flush=True)
    assert all(v["equal"] and v["nbytes"] == nbytes for v in values), values
    want = expected_sha256(np.dtype(spec["dtype"]), spec["numel"], 2)
    assert values[0]["sha256"] == values[1]["sha256"] == want, (values, want)
