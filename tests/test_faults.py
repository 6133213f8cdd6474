"""A process killed mid-run: every survivor fails within the heartbeat timeout, naming the lost peer."""
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from conftest import memfd_arenas  # noqa: E402


def _wait_progress(c, ranks, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(c.tmp, f"progress.{r}")) for r in ranks):
            return
        if any(p.poll() is not None for p in c.workers):
            break
        time.sleep(0.05)
    pytest.fail(f"workers made no progress\n{c.all_logs()}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [0, 1])
def test_killed_server_is_named_by_every_survivor(cluster, victim):
    c = cluster(2, 2)
    c.run_workers("loop", {"sleep": 0.01})
    _wait_progress(c, [0, 1])
    killed_at = time.monotonic()
    c.servers[victim].send_signal(signal.SIGKILL)
    codes = c.wait_workers(timeout=30)
    elapsed = time.monotonic() - killed_at
    assert codes == [0, 0], c.all_logs()  # the scenario catches the error and reports it
    res = c.results()
    for rank in (0, 1):
        err = res[rank]["value"]
        assert err["error_type"] == "PeerLostError", err
        assert "lost server" in err["error"] and "no heartbeat" in err["error"], err
    # heartbeat timeout is 3 s in tests; allow scheduling slack on a busy 2-core machine
    assert elapsed < 15, elapsed
    survivor = c.servers[1 - victim]
    survivor.wait(15)
    c.scheduler.wait(15)
    assert survivor.returncode == 1 and c.scheduler.returncode == 1, c.all_logs()
    assert "lost server" in c.log(f"server{1 - victim}")


def kill_a_worker(c):
    """Worker 1 of ``c`` (2 workers, 1 server) killed mid-run: worker 0 fails naming it, the server
    and the scheduler exit. Worker 0's result (tests/test_ucx.py checks its transport too)."""
    c.run_workers("loop", {"sleep": 0.01})
    _wait_progress(c, [0, 1])
    victim = c.workers[1]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    assert c.workers[0].wait(30) == 0, c.all_logs()
    res = c.results()[0]
    err = res["value"]
    assert err["error_type"] == "PeerLostError", err
    assert "lost worker rank 1" in err["error"], err
    c.servers[0].wait(15)
    c.scheduler.wait(15)
    assert c.servers[0].returncode == 1 and c.scheduler.returncode == 1, c.all_logs()
    return res


@pytest.mark.timeout(90)
def test_killed_worker_is_named_by_every_survivor(cluster):
    kill_a_worker(cluster(2, 1))


@pytest.mark.timeout(90)
def test_killed_scheduler_is_detected(cluster):
    c = cluster(2, 1)
    c.run_workers("loop", {"sleep": 0.01})
    _wait_progress(c, [0, 1])
    c.scheduler.send_signal(signal.SIGKILL)
    codes = c.wait_workers(timeout=30)
    assert codes == [0, 0], c.all_logs()
    for rank in (0, 1):
        err = c.results()[rank]["value"]
        assert err["error_type"] == "PeerLostError" and "lost the scheduler" in err["error"], err
    c.servers[0].wait(15)
    assert c.servers[0].returncode == 1, c.all_logs()
    assert "lost the scheduler" in c.log("server0")


@pytest.mark.timeout(60)
def test_slow_worker_is_not_a_dead_worker(cluster):
    # a pause of 2x the heartbeat timeout: the engine thread keeps heartbeating while training sleeps
    c = cluster(2, 1)
    c.run_workers("slow", {"steps": 3, "pause": 6})
    codes, scodes, sched = c.wait_all(60)
    assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()
    assert all("error" not in r for r in c.results().values()), c.results()


@pytest.mark.timeout(60)
def test_startup_timeout_names_missing_nodes(cluster):
    c = cluster(2, 2, env={"BYTEPS_TIMEOUT": "3"}, start=False)
    c.start(servers=False)
    c.start_server(0)  # server 2 of 2 and worker 1 never come
    c.run_workers("sums", {"tensors": []}, machines=[0])
    c.scheduler.wait(20)
    assert c.scheduler.returncode == 1
    log = c.log("scheduler")
    assert "startup timed out" in log and "1 of 2 servers" in log and "DMLC_WORKER_ID=1" in log, log
    assert c.workers[0].wait(20) != 0
    assert "startup timed out" in c.log("worker0.0"), c.log("worker0.0")


@pytest.mark.timeout(60)
def test_unreachable_scheduler_is_a_clear_error(tmp_path):
    import socket
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    env = dict(os.environ, DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1", DMLC_WORKER_ID="0",
               DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), BYTEPS_TIMEOUT="2")
    p = subprocess.run([sys.executable, "-c", "import byteps; byteps.init()"], env=env, capture_output=True,
                       text=True, timeout=40)
    assert p.returncode != 0
    assert f"127.0.0.1:{port}" in p.stderr and "did not answer" in p.stderr, p.stderr


@pytest.mark.timeout(90)
def test_no_shared_memory_left_after_a_crash(cluster):
    before = set(os.listdir("/dev/shm"))
    c = cluster(1, 1, local_size=2)  # two local processes: local reduce + colocated server, all shm
    c.run_workers("loop", {"sleep": 0.01})
    _wait_progress(c, [0, 1])
    pids = [p.pid for p in [*c.workers, *c.servers]]
    assert all(memfd_arenas(pid) for pid in pids), "the job should be using shared-memory arenas"
    c.workers[1].send_signal(signal.SIGKILL)
    assert c.workers[0].wait(30) == 0, c.all_logs()
    err = c.results()[0]["value"]
    assert err["error_type"] == "PeerLostError" and "lost worker rank 1" in err["error"], err
    c.servers[0].wait(15)
    c.scheduler.wait(15)
    # memfd arenas are never named in /dev/shm, and the kernel frees them with their last holder
    assert set(os.listdir("/dev/shm")) - before == set()
    assert not any(os.path.exists(f"/proc/{pid}") and memfd_arenas(pid) for pid in pids)
