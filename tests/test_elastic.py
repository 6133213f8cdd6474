"""Elastic Summation Service (BYTEPS_ELASTIC=1, docs/elastic.md) on loopback: servers killed with
SIGKILL mid-training and servers joining mid-training, with every step's sums and the final
parameters checked exactly against a locally computed run. The emulated-cluster versions (network
namespaces, tc) are in tests/test_netns_elastic.py."""
import os
import random
import signal
import time

import pytest

ELASTIC = {"BYTEPS_ELASTIC": "1"}


def _progress(c, rank):
    try:
        with open(os.path.join(c.tmp, f"progress.{rank}")) as f:
            return int(f.read() or -1)
    except (OSError, ValueError):
        return -1


def _wait_step(c, step, ranks, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if min(_progress(c, r) for r in ranks) >= step:
            return
        if any(p.poll() is not None for p in c.workers):
            break
        time.sleep(0.01)
    pytest.fail(f"workers did not reach step {step}\n{c.all_logs()}")


def _check(c, n, codes):
    assert codes == [0] * n, c.all_logs()
    res = c.results()
    for r in range(n):
        v = res[r]["value"]
        assert not v["bad"] and v["final_exact"], (r, v["bad"], c.all_logs())
    return res


@pytest.mark.timeout(120)
def test_killed_server_mid_training(cluster):
    """3 workers, 3 servers; one SIGKILLed mid-training: training goes on, every sum exact, and the
    scheduler logs the change with its reason, shares and duration."""
    c = cluster(3, 3, env=ELASTIC)
    c.run_workers("elastic_train", {"steps": 30, "sleep": 0.02})
    _wait_step(c, 5, range(3))
    c.servers[1].send_signal(signal.SIGKILL)
    codes = c.wait_workers(90)
    _check(c, 3, codes)
    log = c.log("scheduler")
    assert "removing server" in log and "server membership 1" in log and "the switch took" in log, log
    for w in range(3):
        assert "servers changed (membership 1" in c.log(f"worker{w}.0"), c.log(f"worker{w}.0")


@pytest.mark.timeout(120)
def test_server_joins_mid_training(cluster):
    """A server started mid-training with BYTEPS_ELASTIC=1 is admitted, and the workers' bytes move to it."""
    c = cluster(2, 1, env=ELASTIC)
    c.run_workers("elastic_train", {"steps": 40, "sleep": 0.02})
    _wait_step(c, 5, range(2))
    c.start_server(1)
    codes = c.wait_workers(90)
    res = _check(c, 2, codes)
    for r in range(2):
        v = res[r]["value"]
        assert v["servers"] == 2, v
        last = v["bytes"][-1]
        assert last.get("1", 0) > 0 and last.get("0", 0) > 0, v["bytes"][-3:]
        assert v["bytes"][0].get("1", 0) == 0
    assert "joined" in c.log("scheduler"), c.log("scheduler")


@pytest.mark.timeout(60)
def test_elastic_refuses_async(cluster):
    c = cluster(1, 1, env={**ELASTIC, "BYTEPS_ENABLE_ASYNC": "1"}, start=False)
    import subprocess
    import sys
    env = dict(c.env, DMLC_ROLE="worker", DMLC_WORKER_ID="0", DMLC_PS_ROOT_PORT="1")
    p = subprocess.run([sys.executable, "-c", "import byteps; byteps.init()"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode != 0 and "BYTEPS_ELASTIC=1 cannot be combined with BYTEPS_ENABLE_ASYNC=1" in p.stderr, p.stderr


@pytest.mark.timeout(90)
def test_losing_the_last_server_ends_the_job(cluster):
    c = cluster(2, 1, env=ELASTIC)
    c.run_workers("elastic_train", {"steps": 10 ** 6, "sleep": 0.01})
    _wait_step(c, 3, range(2))
    c.servers[0].send_signal(signal.SIGKILL)
    codes = c.wait_workers(60)
    assert all(code != 0 for code in codes) or all("error" in c.results().get(r, {}) for r in range(2)), c.all_logs()
    assert "lost server 0" in c.log("scheduler"), c.log("scheduler")
