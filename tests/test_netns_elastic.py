"""Elastic Summation Service on an emulated cluster (bench/netns.py: one network namespace per host,
each host's link rate-limited with tc), as elastic training must survive: a server SIGKILLed mid-training, an extra
CPU server host started mid-training, and (``-m slow``) 20 kills at random moments. Every step's sums
and the final parameters are checked exactly against a locally computed run
(tests/scenarios_elastic.py). Skipped, with the reason, where root or namespaces are unavailable."""
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import netns  # noqa: E402

from byteps import placement  # noqa: E402
from test_elastic import read_progress  # noqa: E402

_WHY = netns.available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"emulated cluster unavailable: {_WHY}")

SCENARIOS = os.path.join(ROOT, "tests", "scenarios.py")
TIMEOUT = 20  # BYTEPS_TIMEOUT of these jobs: a switch must take at most twice this


def byte_shares(results, step):
    """Each server's share of the bytes the workers sent at ``step`` (the transport's counters, summed
    over the workers; a worker's bytes to its own machine's server are a shared-memory descriptor)."""
    per = {}
    for v in results.values():
        for s, b in v["bytes"][step].items():
            per[int(s)] = per.get(int(s), 0) + b
    total = sum(per.values())
    return {s: b / total for s, b in sorted(per.items()) if b}


class ElasticJob:
    """Scheduler on "sched", servers on ``server_hosts``, one worker process on each of ``worker_hosts``
    running ``elastic_train``; every node has BYTEPS_ELASTIC=1."""

    def __init__(self, net, tmp, server_hosts, worker_hosts, args):
        self.net, self.tmp = net, str(tmp)
        self.base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", BYTEPS_ELASTIC="1",
                         BYTEPS_HEARTBEAT_INTERVAL="0.3", BYTEPS_HEARTBEAT_TIMEOUT="3", BYTEPS_TIMEOUT=str(TIMEOUT),
                         BYTEPS_JOB_SECRET=secrets.token_hex(16), DMLC_NUM_WORKER=str(len(worker_hosts)),
                         DMLC_NUM_SERVER=str(len(server_hosts)), DMLC_PS_ROOT_URI=net.addr["sched"],
                         DMLC_PS_ROOT_PORT="9000")
        for name in ("DMLC_ROLE", "DMLC_NODE_HOST", "DMLC_INTERFACE", "DMLC_WORKER_ID"):
            self.base.pop(name, None)
        self.procs = {}
        self.start("sched", "scheduler", [sys.executable, "-m", "byteps.scheduler"], DMLC_ROLE="scheduler")
        for i, host in enumerate(server_hosts):
            self.start_server(host, f"server{i}")
        for wid, host in enumerate(worker_hosts):
            self.start(host, f"worker{wid}", [sys.executable, SCENARIOS, "elastic_train", self.tmp, json.dumps(args)],
                       DMLC_ROLE="worker", DMLC_WORKER_ID=str(wid), PYTHONPATH=os.path.join(ROOT, "tests"))
        self.workers = [f"worker{w}" for w in range(len(worker_hosts))]

    def start(self, host, tag, argv, **extra):
        env = dict(self.base, DMLC_NODE_HOST=self.net.addr[host], **extra)
        with open(os.path.join(self.tmp, f"{tag}.log"), "wb") as log:
            self.procs[tag] = self.net.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_server(self, host, tag):
        self.start(host, tag, [sys.executable, "-m", "byteps.server"], DMLC_ROLE="server")

    def log(self, tag):
        with open(os.path.join(self.tmp, f"{tag}.log"), errors="replace") as f:
            return f.read()

    def logs(self):
        return "\n".join(f"----- {tag}\n{self.log(tag)[-2500:]}" for tag in self.procs)

    def wait_step(self, step, timeout=90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if min(read_progress(self.tmp, r) for r in range(len(self.workers))) >= step:
                return
            if any(self.procs[w].poll() is not None for w in self.workers):
                break
            time.sleep(0.01)
        pytest.fail(f"workers did not reach step {step}\n{self.logs()}")

    def wait_workers(self, timeout):
        deadline = time.monotonic() + timeout
        for w in self.workers:
            try:
                self.procs[w].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{w} still running {timeout} s later\n{self.logs()}")
        codes = [self.procs[w].returncode for w in self.workers]
        assert codes == [0] * len(codes), f"{codes}\n{self.logs()}"
        out = {}
        for r in range(len(self.workers)):
            with open(os.path.join(self.tmp, f"result.{r}.json")) as f:
                res = json.load(f)
            assert "error" not in res, f"rank {r}: {res['error']}\n{self.logs()}"
            v = res["value"]
            assert not v["bad"] and v["final_exact"], f"rank {r}: {v['bad']}\n{self.logs()}"
            out[r] = v
        return out

    def membership_logged(self, members, timeout):
        """Wait until the scheduler logs membership ``members``; the monotonic time it saw it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"server membership {members} (" in self.log("scheduler"):
                return time.monotonic()
            time.sleep(0.01)
        pytest.fail(f"no server membership {members} within {timeout} s\n{self.logs()}")


@pytest.mark.timeout(240)
def test_server_killed_on_emulated_cluster(tmp_path):
    """3 worker machines, servers on w0 and w1 plus one extra CPU machine x0 (2+1); x0's server is
    SIGKILLed mid-training. Training goes on, every sum and the final parameters are exact, the switch
    takes at most 2x BYTEPS_TIMEOUT, and every node logs the change."""
    hosts = ["w0", "w1", "w2", "x0", "sched"]
    with netns.Network(hosts, rate_mbit=400) as net:
        job = ElasticJob(net, tmp_path, ["w0", "w1", "x0"], ["w0", "w1", "w2"], {"steps": 20})
        job.wait_step(4)
        killed = time.monotonic()
        job.procs["server2"].send_signal(signal.SIGKILL)
        switched = job.membership_logged(1, 2 * TIMEOUT)
        results = job.wait_workers(180)
        logs = job.logs()
    assert net.exists() == [], "namespaces left behind"
    assert switched - killed <= 2 * TIMEOUT, f"{switched - killed:.1f} s\n{logs}"
    for r, v in results.items():  # nothing went to the lost server after the switch
        assert v["bytes"][-1].get("2", 0) == 0, (r, v["bytes"][-3:])
    for tag in ("worker0", "worker1", "worker2"):
        assert "servers changed (membership 1" in job.log(tag), f"{tag}\n{logs}"
    for tag in ("server0", "server1"):
        assert "membership 1" in job.log(tag), f"{tag}\n{logs}"


@pytest.mark.timeout(300)
def test_extra_server_host_joins_on_emulated_cluster(tmp_path):
    """3 worker machines with a server each (k = 0); an extra CPU machine's server starts mid-training
    (k = 1). It is admitted, each server's share of the bytes moves to the new Eq. 1-2 shares
    (standalone 2(n-1)/(n²+kn-2k), colocated (n-k)/(n²+kn-2k); measured by the workers' transport
    counters), and every step's sum stays exact. The step time is printed (a benchmark figure)."""
    n, rate = 3, 100
    with netns.Network(["w0", "w1", "w2", "x0", "sched"], rate_mbit=rate) as net:
        job = ElasticJob(net, tmp_path, ["w0", "w1", "w2"], ["w0", "w1", "w2"], {"steps": 30, "times": True})
        job.wait_step(10)
        job.start_server("x0", "server3")
        job.membership_logged(1, 2 * TIMEOUT)
        results = job.wait_workers(240)
    assert net.exists() == [], "namespaces left behind"
    before, after = byte_shares(results, 5), byte_shares(results, -1)
    # k = 0: every colocated server takes 1/n of the model from each of the other n-1 machines
    for s in range(3):
        assert abs(before[s] - 1 / 3) < 0.03, before
    # k = 1: the standalone server takes its Eq. 1 share from all n machines, the colocated ones their
    # Eq. 2 share from the other n-1: bytes in the ratio n·2(n-1) : (n-1)(n-k) per colocated server
    w_std, w_col = 2 * (n - 1), n - 1
    total = n * w_std + 3 * (n - 1) * w_col
    assert abs(after[3] - n * w_std / total) < 0.03, (after, n * w_std / total)
    for s in range(3):
        assert abs(after[s] - (n - 1) * w_col / total) < 0.03, (after, (n - 1) * w_col / total)
    t0, t1 = (placement.plan(n, k, 1 << 20, 1.0).t_opt for k in (0, 1))
    times = [v["times"] for v in results.values()]
    pre = sorted(max(t[i] for t in times) for i in range(3, 10))[3]
    post = sorted(max(t[i] for t in times) for i in range(-8, 0))[4]
    print(f"step time {pre:.3f} s -> {post:.3f} s ({post / pre:.2f}x; the plan predicts {t1 / t0:.2f}x)")
    # The step time is a speed figure, not asserted here: bench/bench_elastic.py measures it (0.94-0.96x
    # against the plan's 0.90x on a quiet machine, docs/benchmarks.md), and a loaded 2-core CI machine
    # read 1.11x once, where the extra server's process competes for the cores. Asserted: the byte
    # shares above (the placement the plan makes), and that every step's sum was exact (wait_workers).


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_twenty_kill_trials_on_emulated_cluster(tmp_path):
    """20 trials: a random server SIGKILLed at a random moment (step and delay): no hang, no wrong sum."""
    rng = random.Random(19)
    for trial in range(20):
        where = tmp_path / f"trial{trial}"
        where.mkdir()
        with netns.Network(["w0", "w1", "w2", "x0", "sched"], rate_mbit=400) as net:
            job = ElasticJob(net, where, ["w0", "w1", "x0"], ["w0", "w1", "w2"], {"steps": 12})
            job.wait_step(rng.randrange(0, 8))
            time.sleep(rng.random() * 0.2)
            job.procs[f"server{rng.randrange(3)}"].send_signal(signal.SIGKILL)
            job.wait_workers(120)
        assert net.exists() == []
