"""Multi-host behaviour on an emulated cluster (bench/netns.py): a network partition is reported like a
killed peer, and every service binds to its host's own address, never to all interfaces.
Skipped, with the reason, where root or network namespaces are unavailable."""
import os
import secrets
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import netns  # noqa: E402

_WHY = netns.available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"emulated cluster unavailable: {_WHY}")

#: a worker that push_pulls until something fails, then dies of it (uncaught: exit code 1)
WORKER = """
import os, sys, time
import torch
import byteps.torch as bps
bps.init()
t = torch.ones(50000)
progress = os.path.join(sys.argv[1], f"progress.{bps.rank()}.{bps.local_rank()}")
steps = int(sys.argv[2])
for step in range(steps):
    out = bps.push_pull(t, average=False, name="loop")
    assert out[0].item() == bps.size(), out[0].item()
    with open(progress, "w") as f:
        f.write(str(step))
    time.sleep(float(sys.argv[3]))
bps.shutdown()
"""


class Job:
    """Scheduler on host "sched", a server on each of `server_hosts`, worker processes on `workers`
    (host, worker id, local size, extra env); every output goes to tmp/<tag>.log."""

    def __init__(self, net, tmp, server_hosts, workers, steps, sleep, env=None):
        self.net, self.tmp = net, str(tmp)
        script = os.path.join(self.tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", BYTEPS_HEARTBEAT_INTERVAL="0.3",
                    BYTEPS_HEARTBEAT_TIMEOUT="3", BYTEPS_TIMEOUT="20", BYTEPS_JOB_SECRET=secrets.token_hex(16),
                    BYTEPS_LOG_LEVEL="INFO", DMLC_NUM_WORKER=str(len({w for _, w, _, _ in workers})),
                    DMLC_NUM_SERVER=str(len(server_hosts)), DMLC_PS_ROOT_URI=net.addr["sched"],
                    DMLC_PS_ROOT_PORT="9000", **(env or {}))
        for name in ("DMLC_ROLE", "DMLC_NODE_HOST", "DMLC_INTERFACE", "DMLC_WORKER_ID"):
            base.pop(name, None)
        self.procs = {}

        def start(host, tag, argv, **extra):
            env = dict(base, **extra)
            if "DMLC_INTERFACE" not in env:
                env["DMLC_NODE_HOST"] = net.addr[host]
            with open(os.path.join(self.tmp, f"{tag}.log"), "wb") as log:
                self.procs[tag] = net.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT)

        start("sched", "scheduler", [sys.executable, "-m", "byteps.scheduler"], DMLC_ROLE="scheduler")
        for i, host in enumerate(server_hosts):
            start(host, f"server{i}", [sys.executable, "-m", "byteps.server"], DMLC_ROLE="server")
        for host, wid, local_size, extra in workers:
            for lr in range(local_size):
                start(host, f"worker{wid}.{lr}", [sys.executable, script, self.tmp, str(steps), str(sleep)],
                      DMLC_ROLE="worker", DMLC_WORKER_ID=str(wid), BYTEPS_LOCAL_SIZE=str(local_size),
                      BYTEPS_LOCAL_RANK=str(lr), **extra)

    def log(self, tag):
        with open(os.path.join(self.tmp, f"{tag}.log"), errors="replace") as f:
            return f.read()

    def logs(self):
        return "\n".join(f"----- {tag}\n{self.log(tag)[-2000:]}" for tag in self.procs)

    def wait_progress(self, names, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(os.path.exists(os.path.join(self.tmp, f"progress.{n}")) for n in names):
                return
            failed = [t for t, p in self.procs.items() if p.poll() not in (None, 0)]
            if failed:
                break
            time.sleep(0.05)
        pytest.fail(f"no progress\n{self.logs()}")

    def wait_all(self, timeout):
        deadline = time.monotonic() + timeout
        for tag, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{tag} still running {timeout} s later\n{self.logs()}")
        return {tag: p.returncode for tag, p in self.procs.items()}


@pytest.mark.timeout(180)
def test_network_partition_is_a_lost_peer(tmp_path):
    """Worker machine w1's link goes down mid-run: every process reports the lost peer (or the lost
    scheduler, on the cut-off machine) and exits non-zero within the heartbeat timeout; nothing is
    left running and every namespace is removed."""
    with netns.Network(["w0", "w1", "x0", "sched"], rate_mbit=1000) as net:
        job = Job(net, tmp_path, ["w0", "w1", "x0"], [("w0", 0, 1, {}), ("w1", 1, 1, {})], steps=10 ** 9,
                  sleep=0.01)
        job.wait_progress(["0.0", "1.0"])
        cut = time.monotonic()
        net.link("w1", up=False)
        codes = job.wait_all(timeout=45)
        elapsed = time.monotonic() - cut
        procs = list(net.procs)
    assert net.exists() == [], "namespaces left behind"
    assert all(p.poll() is not None for p in procs), "processes left running"
    logs = job.logs()
    assert all(code != 0 for code in codes.values()), f"{codes}\n{logs}"
    # heartbeat timeout 3 s; generous slack for a busy 2-core machine
    assert elapsed < 30, f"{elapsed:.1f} s\n{logs}"
    w1 = net.addr["w1"]
    on_w1 = ("lost worker rank 1", f"({w1}:")  # the worker or the server of the cut-off machine
    for tag in ("scheduler", "server0", "server2", "worker0.0"):  # the survivors name the peer on w1
        text = job.log(tag)
        assert "lost" in text and any(m in text for m in on_w1), f"{tag} does not name the lost peer\n{logs}"
    assert "PeerLostError" in job.log("worker0.0"), logs
    for tag in ("server1", "worker1.0"):  # cut off: they lose the scheduler
        assert "lost the scheduler" in job.log(tag), f"{tag}\n{logs}"


def listeners(net, host):
    """Local addresses of the TCP sockets listening inside `host` (ss -ltnH)."""
    out = net.run(host, ["ss", "-ltnH"]).stdout
    return [line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()]


@pytest.mark.timeout(180)
def test_services_bind_to_the_configured_address_only(tmp_path):
    """Scheduler, servers and workers bind to their host's address from DMLC_NODE_HOST or
    DMLC_INTERFACE (a worker machine's processes also to loopback, for their local reduce), never
    to 0.0.0.0 / [::] / *."""
    with netns.Network(["w0", "w1", "x0", "sched"]) as net:
        workers = [("w0", 0, 2, {}),                                  # DMLC_NODE_HOST, two local processes
                   ("w1", 1, 1, {"DMLC_INTERFACE": "eth0"})]          # the address of an interface
        job = Job(net, tmp_path, ["w0", "x0"], workers, steps=400, sleep=0.02)
        job.wait_progress(["0.0", "1.1", "2.0"])  # rank.local_rank
        seen = {h: listeners(net, h) for h in ("sched", "w0", "w1", "x0")}
        codes = job.wait_all(timeout=90)
    assert set(codes.values()) == {0}, f"{codes}\n{job.logs()}"
    assert seen["sched"] == [net.addr["sched"]], seen        # the scheduler's one ROUTER
    assert net.addr["x0"] in seen["x0"] and net.addr["w0"] in seen["w0"], seen  # the servers
    assert seen["w0"].count("127.0.0.1") == 2, seen          # the two local processes' local ROUTERs
    for host, addrs in seen.items():
        for a in addrs:
            assert a in (net.addr[host], "127.0.0.1"), f"{host} listens on {a}: {seen}"
    assert "is colocated" in job.log("server0") and "is standalone" in job.log("server1"), job.logs()
