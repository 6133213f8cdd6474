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


def read_progress(outdir, rank):
    """The last step rank ``rank`` finished (scenarios_elastic.py writes it), or -1."""
    try:
        with open(os.path.join(outdir, f"progress.{rank}")) as f:
            return int(f.read() or -1)
    except (OSError, ValueError):
        return -1


def _wait_step(c, step, ranks, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if min(read_progress(c.tmp, r) for r in ranks) >= step:
            return
        if any(p.poll() is not None for p in c.workers):
            break
        time.sleep(0.01)
    pytest.fail(f"workers did not reach step {step}\n{c.all_logs()}")


def _check(c, n, codes):
    assert codes == [0] * n, c.all_logs()
    res = c.results()
    for r in range(n):
        assert "value" in res[r], (r, res[r], c.all_logs())
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
    """A server started mid-training by ``bpslaunch --join HOST:PORT`` with only the job's secret (no
    DMLC_* or other BYTEPS_* variable) is admitted, and the workers' bytes move to it."""
    import subprocess
    import sys
    c = cluster(2, 1, env=ELASTIC)
    c.run_workers("elastic_train", {"steps": 40, "sleep": 0.02})
    _wait_step(c, 5, range(2))
    bpslaunch = os.path.join(os.path.dirname(sys.executable), "bpslaunch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env["BYTEPS_JOB_SECRET"] = c.env["BYTEPS_JOB_SECRET"]
    with open(os.path.join(c.tmp, "server1.log"), "wb") as out:
        c.servers.append(subprocess.Popen([bpslaunch, "--join", f"127.0.0.1:{c.port}"], env=env, stdout=out,
                                          stderr=subprocess.STDOUT))
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


def _kill_trial(cluster, seed, workers=3, servers=3, local_size=1, env=None, kills=1, sig=signal.SIGKILL):
    """One trial: training, and ``kills`` servers sent ``sig`` at random moments; every sum exact."""
    rng = random.Random(seed)
    c = cluster(workers, servers, local_size=local_size, env={**ELASTIC, **(env or {})}, subdir=f"trial{seed}")
    c.run_workers("elastic_train", {"steps": 25, "sleep": rng.choice([0, 0.005, 0.02])})
    ranks = range(workers * local_size)
    victims = rng.sample(range(servers), kills)
    for v in victims:
        _wait_step(c, rng.randrange(1, 12), ranks)
        time.sleep(rng.random() * 0.03)
        c.servers[v].send_signal(sig)
    codes = c.wait_workers(90)
    _check(c, workers * local_size, codes)
    c.kill_all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(4))
def test_kill_trials(cluster, seed):
    """Servers killed at random moments (one, or two of three): no hang, no wrong sum."""
    _kill_trial(cluster, seed, kills=1 + seed % 2)


@pytest.mark.timeout(120)
def test_killed_server_with_local_reduce(cluster):
    """Two processes per machine: the owners' pushes of a lost server's partitions go to its replacement."""
    _kill_trial(cluster, 7, workers=2, servers=3, local_size=2)


@pytest.mark.timeout(120)
def test_stopped_server_found_by_heartbeat(cluster):
    """A stopped server (SIGSTOP) breaks no link, so nothing fails at once: the scheduler's heartbeat
    time-out finds the lost server, within BYTEPS_HEARTBEAT_TIMEOUT, well inside the ops' BYTEPS_TIMEOUT."""
    _kill_trial(cluster, 11, sig=signal.SIGSTOP)


@pytest.mark.timeout(120)
def test_server_lost_while_replying(cluster):
    """The case no re-push alone can fix: a server that answered a round to some workers and died before
    the others got it. Rank 2 is stopped (SIGSTOP) so its replies pile up unread until its socket
    buffer is full, the server is killed, and rank 2 resumes: the workers that got the result send it
    to the replacement (RESULT), which answers rank 2's re-push with it. Every sum stays exact."""
    c = cluster(3, 3, env=ELASTIC)
    c.run_workers("elastic_train", {"steps": 16, "big": 6_000_000})
    _wait_step(c, 3, range(3))
    victim = c.workers[2]
    victim.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)
        c.servers[0].send_signal(signal.SIGKILL)
        time.sleep(0.3)
    finally:
        victim.send_signal(signal.SIGCONT)
    codes = c.wait_workers(90)
    res = _check(c, 3, codes)
    assert sum(res[r]["value"]["results_sent"] for r in range(3)) > 0, c.all_logs()


def _push(sock, cmd, sender, key, rnd, data):
    """A data message as worker ``sender`` sends it: float32 ``data`` for (key, round)."""
    from byteps.core import dtypes, wire
    body = data.tobytes()
    sock.send_multipart([wire.pack(cmd, sender=sender, key=key, round=rnd, length=len(body), dtype=dtypes.FLOAT32),
                         body])


def _reply(sock, timeout=10.0):
    import numpy as np
    from byteps.core import wire
    if not sock.poll(timeout * 1000):
        return None, None
    header, body = sock.recv_multipart()
    return wire.unpack(header), np.frombuffer(body, dtype=np.float32)


@pytest.mark.timeout(120)
def test_replacement_server_takes_results(cluster):
    """The replacement's side of RESULT, message by message against a real server (BYTEPS_ELASTIC=1),
    with two job members' direct links speaking for ranks 0 and 1 (data travels over links only): a
    RESULT completes the round a rank pushed again, answers a rank that pushes a completed round again,
    older RESULTs are dropped, and the next round sums as usual."""
    import sys
    import numpy as np
    import zmq
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import member_link, server_data_port
    from byteps.core import wire
    Cmd = wire.Cmd

    c = cluster(2, 1, env=ELASTIC)
    c.run_workers("wait_then_sum", {"wait": 120})  # the server gets its address book (ranks 0 and 1)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(c.tmp, f"progress.{r}")) for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in c.workers), c.all_logs()
        time.sleep(0.05)
    ctx = zmq.Context()
    links = []
    try:
        port = server_data_port(c.servers[0].pid)
        links += [member_link(ctx, port), member_link(ctx, port)]
        a, b = links
        result = np.arange(1000, dtype=np.float32)
        # key 1: rank 0 had round 5's result, rank 1 did not; the RESULT comes first
        k1 = wire.make_key(900, 1)
        _push(a, Cmd.RESULT, 0, k1, 5, result)
        assert _reply(a, 0.5) == (None, None)  # a RESULT is not answered
        _push(b, Cmd.PUSHPULL, 1, k1, 5, np.full(1000, 7, np.float32))
        h, got = _reply(b)
        assert h.cmd == Cmd.REPLY and h.round == 5 and np.array_equal(got, result), (h, got)
        # key 2: rank 1 pushes round 3 again first, then rank 0's RESULT completes it; an older RESULT is dropped
        k2 = wire.make_key(900, 2)
        _push(b, Cmd.PUSHPULL, 1, k2, 3, np.full(1000, 9, np.float32))
        assert _reply(b, 0.5) == (None, None)  # waits for rank 0
        _push(a, Cmd.RESULT, 0, k2, 2, result - 1)
        _push(a, Cmd.RESULT, 0, k2, 3, result + 1)
        h, got = _reply(b)
        assert h.round == 3 and np.array_equal(got, result + 1), (h, got)
        # the next round of both keys sums as usual
        for k, rnd in ((k1, 6), (k2, 4)):
            _push(a, Cmd.PUSHPULL, 0, k, rnd, np.full(1000, 2, np.float32))
            _push(b, Cmd.PUSHPULL, 1, k, rnd, np.full(1000, 3, np.float32))
            for s in (a, b):
                h, got = _reply(s)
                assert h.cmd == Cmd.REPLY and h.round == rnd and np.array_equal(got, np.full(1000, 5, np.float32))
        assert "completed with a worker's copy of the lost server's result for 1 waiting" in c.log("server0"), \
            c.log("server0")
        assert "pushed round 5 again after it completed here" in c.log("server0"), c.log("server0")
    finally:
        for link in links:
            link.close()
        ctx.destroy(linger=0)


@pytest.mark.timeout(180)
def test_bpslaunch_local_job_survives_a_lost_server(tmp_path):
    """``bpslaunch --local`` with BYTEPS_ELASTIC=1: a server SIGKILLed mid-training does not stop the
    job (bpslaunch warns; the scheduler removes it), and the job ends with exit code 0, every sum exact."""
    import subprocess
    import sys

    import psutil

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(BYTEPS_ELASTIC="1", BYTEPS_HEARTBEAT_INTERVAL="0.2", BYTEPS_HEARTBEAT_TIMEOUT="3",
               BYTEPS_TIMEOUT="30", PYTHONUNBUFFERED="1")
    bpslaunch = os.path.join(os.path.dirname(sys.executable), "bpslaunch")
    p = subprocess.Popen([bpslaunch, "--local", "--workers", "2", "--servers", "3", "--",
                          sys.executable, os.path.join(here, "scenarios.py"), "elastic_train", str(tmp_path),
                          '{"steps": 40, "sleep": 0.02}'], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not all(os.path.exists(tmp_path / f"progress.{r}") for r in (0, 1)):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0]
            time.sleep(0.05)
        servers = [c for c in psutil.Process(p.pid).children(recursive=True)
                   if "byteps.server" in " ".join(c.cmdline())]
        assert len(servers) == 3, servers
        servers[1].send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    assert "the job goes on without it" in out, out
    for r in (0, 1):
        import json
        v = json.loads((tmp_path / f"result.{r}.json").read_text())["value"]
        assert not v["bad"] and v["final_exact"], v


# ---------------------------------------------------------------- servers lost during start-up
#: INFO: the scheduler logs registrations and "epoch 0 running", which the tests below wait for
STARTUP = {**ELASTIC, "BYTEPS_LOG_LEVEL": "INFO"}


def _wait_log(c, name, text, timeout=60, count=1):
    deadline = time.monotonic() + timeout
    while c.log(name).count(text) < count:
        assert time.monotonic() < deadline and c.scheduler.poll() is None, f"no {text!r} in {name}\n{c.all_logs()}"
        time.sleep(0.01)


def _check_startup_loss(c, servers_left):
    """The job trained exactly on the servers left, and no worker waited out a time-out (BYTEPS_TIMEOUT
    is 30 s: a worker that waited for the lost server's answer fails init() with an error)."""
    codes = c.wait_workers(90)
    res = _check(c, 2, codes)
    assert "removing server" in c.log("scheduler"), c.log("scheduler")
    for w in range(2):  # nor did one wait out its limit for the lost server's LINK answer (10 s)
        assert "did not answer LINK" not in c.log(f"worker{w}.0"), c.log(f"worker{w}.0")
    for r in range(2):
        last = res[r]["value"]["bytes"][-1]
        assert len([s for s, n in last.items() if n > 0]) == servers_left, (r, last)
    return res


@pytest.mark.timeout(120)
def test_server_lost_during_registration(cluster):
    """A server that registered and died before the workers came: the job starts with the other two
    (it used to wait for DMLC_NUM_SERVER servers, then fail)."""
    c = cluster(2, 3, env=STARTUP)
    _wait_log(c, "scheduler", "registered server", count=3)
    c.servers[1].send_signal(signal.SIGKILL)
    _wait_log(c, "scheduler", "before the job started")
    c.run_workers("elastic_train", {"steps": 8, "sleep": 0.2})
    _check_startup_loss(c, servers_left=2)
    assert "the job starts with 2 servers" in c.log("scheduler"), c.log("scheduler")


@pytest.mark.timeout(120)
def test_server_that_never_registers(cluster):
    """A server killed before it could register is unknown to the scheduler: once every worker is in,
    the job waits BYTEPS_HEARTBEAT_TIMEOUT for it (the silence after which a registered one is lost),
    then starts with the two that came."""
    c = cluster(2, 3, env=STARTUP, start=False).start(servers=False)
    c.start_server(0)
    c.start_server(1)
    c.run_workers("elastic_train", {"steps": 8, "sleep": 0.2})
    codes = c.wait_workers(90)
    res = _check(c, 2, codes)
    assert "1 server(s) did not register within 3 s" in c.log("scheduler"), c.log("scheduler")
    assert all(len([n for n in res[r]["value"]["bytes"][-1].values() if n > 0]) == 2 for r in range(2)), res


@pytest.mark.timeout(120)
def test_server_lost_before_acknowledging_the_address_book(cluster):
    """A server frozen (SIGSTOP) after it registered never acknowledges the address book: the scheduler
    removes it after its heartbeat time-out and gives the workers the book, with the loss; they do
    not wait for its authentication, and the first membership already leaves it out."""
    c = cluster(2, 3, env={**STARTUP, "BYTEPS_HEARTBEAT_TIMEOUT": "10"})  # longer than the workers take to register
    _wait_log(c, "scheduler", "registered server", count=3)
    c.servers[2].send_signal(signal.SIGSTOP)
    try:
        c.run_workers("elastic_train", {"steps": 8, "sleep": 0.2})
        _check_startup_loss(c, servers_left=2)
    finally:
        c.servers[2].send_signal(signal.SIGKILL)
    for w in range(2):
        assert "left the job during start-up" in c.log(f"worker{w}.0"), c.log(f"worker{w}.0")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0.0, 0.1])
def test_server_killed_while_workers_start(cluster, delay):
    """SIGKILL of a server ``delay`` s after the workers got the address book: while they authenticate,
    probe links, agree on the partition size and open direct links. The scheduler removes it after
    its heartbeat time-out; workers still in init() stop waiting for it at once, and training is exact."""
    c = cluster(2, 3, env=STARTUP)
    c.run_workers("elastic_train", {"steps": 8, "sleep": 0.2})
    _wait_log(c, "scheduler", "epoch 0 running")
    time.sleep(delay)
    c.servers[0].send_signal(signal.SIGKILL)
    _check_startup_loss(c, servers_left=2)


def _phase_of_loss(c):
    """Where the job was when it lost its server, from the logs."""
    if "before the job started" in c.log("scheduler") or "did not register within" in c.log("scheduler"):
        return "registration"
    if any("left the job during start-up" in c.log(f"worker{w}.0") for w in range(2)):
        return "init"
    return "training" if "removing server" in c.log("scheduler") else "after the last step"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(20))
def test_server_killed_at_any_moment(cluster, seed):
    """SIGKILL of a random server at a random moment from the processes' start to the end of training
    (uniform over 0-7 s: registration, init() and about 3 s of training, on this machine): the job
    never ends while another server lives, and the final parameters equal the undisturbed run's."""
    rng = random.Random(seed)
    c = cluster(2, 3, env=STARTUP)
    c.run_workers("elastic_train", {"steps": 30, "sleep": 0.1})
    time.sleep(rng.uniform(0, 7))
    c.servers[rng.randrange(3)].send_signal(signal.SIGKILL)
    _check(c, 2, c.wait_workers(90))
    print(f"seed {seed}: server lost during {_phase_of_loss(c)}")


@pytest.mark.timeout(120)
def test_frozen_server_resumes_and_leaves_with_the_reason(cluster):
    """A server frozen (SIGSTOP) long enough to be removed, then resumed (SIGCONT): it reads the
    scheduler's TERMINATE and leaves saying it was removed from the job and why, rather than
    reporting a lost scheduler; training goes on exactly."""
    c = cluster(2, 3, env=ELASTIC)
    c.run_workers("elastic_train", {"steps": 30, "sleep": 0.05})
    _wait_step(c, 3, range(2))
    c.servers[1].send_signal(signal.SIGSTOP)
    _wait_log(c, "scheduler", "removing server")  # (its index is by address: not necessarily 1)
    c.servers[1].send_signal(signal.SIGCONT)
    assert c.servers[1].wait(30) == 0, c.log("server1")
    log = c.log("server1")
    assert "leaves the job: removed from the job: lost server" in log and "lost the scheduler" not in log, log
    _check(c, 2, c.wait_workers(90))


@pytest.mark.timeout(60)
def test_join_refused_by_a_job_that_is_not_elastic(cluster):
    """``bpslaunch --join`` against a job whose scheduler lacks BYTEPS_ELASTIC=1: the server stops at
    once, saying why."""
    import subprocess
    import sys
    c = cluster(1, 1, env={"BYTEPS_LOG_LEVEL": "INFO"})
    _wait_log(c, "scheduler", "registered server")  # the job's own server first
    bpslaunch = os.path.join(os.path.dirname(sys.executable), "bpslaunch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env["BYTEPS_JOB_SECRET"] = c.env["BYTEPS_JOB_SECRET"]
    p = subprocess.run([bpslaunch, "--join", f"127.0.0.1:{c.port}"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode != 0 and "does not have BYTEPS_ELASTIC=1" in p.stdout + p.stderr, p.stdout + p.stderr
