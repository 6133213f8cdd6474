"""Authentication (core/auth.py): strangers are refused and cannot inject gradients; a worker
refuses a scheduler that cannot prove the job's secret. The harness gives every test job a secret."""
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from conftest import server_data_port  # noqa: E402
from byteps.core import wire  # noqa: E402


@pytest.mark.timeout(90)
def test_worker_with_wrong_secret_is_refused_and_job_goes_on(cluster):
    c = cluster(2, 1)
    # a wrong secret: the stranger finds the scheduler cannot prove *its* secret, and gives up
    c.run_workers("sums", {"tensors": []}, env={"BYTEPS_JOB_SECRET": "not-the-secret"}, machines=[0])
    assert c.workers[0].wait(30) != 0
    assert "could not prove it knows BYTEPS_JOB_SECRET" in c.log("worker0.0"), c.log("worker0.0")
    # no secret at all: it registers in the clear and the scheduler refuses it
    c.run_workers("sums", {"tensors": []}, env={"BYTEPS_JOB_SECRET": ""}, machines=[1])
    assert c.workers[1].wait(30) != 0
    assert "authentication failed" in c.log("worker1.0"), c.log("worker1.0")
    assert "refused REGISTER" in c.log("scheduler"), c.log("scheduler")
    specs = [{"name": "t", "shape": [5], "dtype": "int64"}]
    c.workers = []
    c.run_workers("sums", {"tensors": specs, "rounds": 2})
    codes, scodes, sched = c.wait_all(60)
    assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()


@pytest.mark.timeout(90)
def test_unauthenticated_data_never_enters_a_sum(cluster):
    c = cluster(2, 1)
    time.sleep(0.5)
    port = server_data_port(c.servers[0].pid)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        junk = (b"\xff" * 40)
        # the first partitions of the first tensor keys, round 0, pretending to be rank 0
        for tkey in range(1, 4):
            sock.send_multipart([wire.pack(wire.Cmd.PUSHPULL, sender=0, key=wire.make_key(tkey, 0), round=0,
                                           length=len(junk), dtype=5), junk])
        time.sleep(0.3)
        specs = [{"name": f"t{i}", "shape": [5], "dtype": "int64"} for i in range(3)]
        c.run_workers("sums", {"tensors": specs, "rounds": 1})
        codes, scodes, sched = c.wait_all(60)
        assert codes == [0, 0], c.all_logs()
        res = c.results()
        assert all("error" not in r for r in res.values()), res
        assert res[0]["value"] == res[1]["value"]
        assert sock.poll(200) == 0, "the server answered a stranger"
    finally:
        ctx.destroy(linger=0)
    assert "ignored data from an unauthenticated peer" in c.log("server0"), c.log("server0")
    # the sums themselves are checked against ground truth elsewhere; here: the same as a clean job
    clean = cluster(2, 1, subdir="clean")
    clean.run_workers("sums", {"tensors": specs, "rounds": 1})
    clean.wait_all(60)
    assert clean.results()[0]["value"] == res[0]["value"]


@pytest.mark.timeout(60)
def test_worker_refuses_a_scheduler_that_cannot_prove_the_secret(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def fake_scheduler():
        while not stop.is_set():
            if router.poll(100):
                ident, header, _ = router.recv_multipart()
                if wire.unpack(header).cmd == wire.Cmd.HELLO:
                    router.send_multipart([ident] + wire.control(wire.Cmd.CHALLENGE, body={"nonce": "00",
                                                                                         "proof": "forged"}))

    t = threading.Thread(target=fake_scheduler, daemon=True)
    t.start()
    try:
        env = dict(os.environ, DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1", DMLC_WORKER_ID="0",
                   DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), BYTEPS_TIMEOUT="10",
                   BYTEPS_JOB_SECRET="the-real-secret")
        p = subprocess.run([sys.executable, "-c", "import byteps; byteps.init()"], env=env, capture_output=True,
                           text=True, timeout=40)
    finally:
        stop.set()
        t.join(5)
        ctx.destroy(linger=0)
    assert p.returncode != 0
    assert "could not prove it knows BYTEPS_JOB_SECRET" in p.stderr, p.stderr


def test_secret_never_appears_on_the_wire():
    from byteps.core import auth

    secret = b"s3cret-value"
    gate, knock = auth.Gate(secret), auth.Knock(secret, b"client-identity")
    challenge = gate.challenge(b"client-identity", knock.hello())
    mac = knock.answer(challenge, "test")
    for message in (knock.hello(), challenge, {"mac": mac}):
        assert b"s3cret" not in repr(message).encode()
    assert gate.check(b"client-identity", mac) and gate.allows(b"client-identity")
    # a replayed MAC fails: the nonce was used up
    assert not gate.check(b"client-identity", mac)
    # a wrong secret fails both ways
    other = auth.Knock(b"wrong", b"x")
    with pytest.raises(auth.AuthError):
        other.answer(gate.challenge(b"x", other.hello()), "test")
    assert not gate.check(b"x", auth.client_mac(b"wrong", "00", b"x"))


@pytest.mark.timeout(60)
def test_secret_only_on_workers_is_reported_at_once(cluster):
    # scheduler and server without a secret, workers with one: the workers learn why immediately
    # (the scheduler answers their HELLO with an error naming BYTEPS_JOB_SECRET), no time-out
    c = cluster(2, 1, start=False)
    c.env.pop("BYTEPS_JOB_SECRET")
    c.start(servers=False)
    c.start_server(0)
    start = time.monotonic()
    c.run_workers("sums", {"tensors": []}, env={"BYTEPS_JOB_SECRET": "s"}, machines=[0, 1])
    for p in c.workers:
        assert p.wait(25) != 0
    assert time.monotonic() - start < 20  # BYTEPS_TIMEOUT is 30 in tests
    log = c.log("worker0.0")
    assert "BYTEPS_JOB_SECRET" in log, log


def test_open_handshakes_are_bounded_and_expire():
    """A stranger's HELLO opens a handshake; 100,000 of them from distinct identities leave at most
    PENDING_LIMIT open (the oldest go first) and the gate's memory flat; an open handshake expires
    after PENDING_TTL_S (its AUTH then fails), and a member's handshake still passes."""
    import tracemalloc

    from byteps.core import auth

    now = [0.0]
    secret = b"s3cret"
    gate = auth.Gate(secret, clock=lambda: now[0])
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(100_000):
        gate.challenge(b"stranger-%d" % i, {"nonce": "00"})
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert gate.open_handshakes() == auth.PENDING_LIMIT
    assert grown < 4 << 20, f"the gate kept {grown} bytes for 100,000 strangers"
    # a member's handshake passes; one answered after PENDING_TTL_S does not
    member = auth.Knock(secret, b"member")
    mac = member.answer(gate.challenge(b"member", member.hello()), "gate")
    assert gate.check(b"member", mac) and gate.allows(b"member")
    late = auth.Knock(secret, b"late")
    mac = late.answer(gate.challenge(b"late", late.hello()), "gate")
    now[0] += auth.PENDING_TTL_S + 1
    assert not gate.check(b"late", mac) and not gate.allows(b"late")
    gate.challenge(b"next", {"nonce": "00"})  # expired handshakes go at the next HELLO
    assert gate.open_handshakes() == 1


def test_warnings_about_strangers_are_throttled(caplog):
    """At most ``limit`` warnings per window; the first after it says how many were not logged."""
    import logging

    from byteps.log import Throttled

    now = [0.0]
    t = Throttled(limit=10, window_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="byteps"):
        for i in range(1000):
            t.warning("stranger %d", i)
        assert len(caplog.records) == 10 and t.suppressed == 990
        now[0] += 61
        t.warning("stranger again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[10] == "... 990 more such warnings were not logged in the last 60 s", lines[10:]
    assert lines[11] == "stranger again" and len(lines) == 12


def test_a_flood_of_one_warning_does_not_hide_another(caplog):
    """Each kind of warning (its format string) has its own budget: a thousand malformed messages
    still leave room for the first stranger's line."""
    import logging

    from byteps.log import Throttled

    t = Throttled(limit=10, window_s=60.0, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger="byteps"):
        for i in range(1000):
            t.warning("malformed %d", i)
        t.warning("stranger %r", "x")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 11 and lines[-1] == "stranger 'x'" and t.suppressed == 990, lines


@pytest.mark.timeout(420)
@pytest.mark.parametrize("hellos", [20_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_a_flood_of_hellos_leaves_the_server_flat(cluster, hellos):
    """``hellos`` HELLOs from distinct identities (each its own connection, from 4 loopback source
    addresses so that their ports do not run out), each answered, while a job runs, cost its server
    a few MB at most and no log line each, and the job's sums stay exact. 20,000 (about 5 times the
    open handshakes a server keeps, auth.PENDING_LIMIT) in the default suite, 100,000 with -m slow."""
    import psutil

    c = cluster(2, 1, env={"BYTEPS_LOG_LEVEL": "INFO"})  # the server logs how many messages Python took
    c.run_workers("wait_then_sum", {"wait": 300})  # one exact sum, then they wait for OUTDIR/go
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(c.tmp, f"progress.{r}")) for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in c.workers), c.all_logs()
        time.sleep(0.05)
    server = psutil.Process(c.servers[0].pid)
    port = server_data_port(server.pid)
    rss0 = server.memory_info().rss
    hello = wire.control(wire.Cmd.HELLO, body={"nonce": "00" * 16})  # [header, body]
    # a connection that closes before its HELLO is read loses it (ZeroMQ drops a gone peer's queue):
    # each stranger waits for its CHALLENGE, 250 at a time, from 4 loopback source addresses
    ctx = zmq.Context()
    try:
        for first in range(0, hellos, 250):
            if first == hellos // 2:  # half-way: the second half must not grow it (flat, not per stranger)
                half = server.memory_info().rss
            batch = []
            for i in range(first, first + 250):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.IDENTITY, b"s%07d" % i)
                s.connect(f"tcp://127.0.0.{2 + i % 4}:0;127.0.0.1:{port}")
                s.send_multipart(hello)
                batch.append(s)
            for s in batch:
                assert s.poll(30000), "a stranger's HELLO got no CHALLENGE"
                s.recv_multipart()
                s.close()
    finally:
        ctx.destroy(linger=0)
    deadline = time.monotonic() + 120  # until the server has taken them all
    while time.monotonic() < deadline and server.cpu_percent(0.5) > 5:
        pass
    grown, second = server.memory_info().rss - rss0, server.memory_info().rss - half
    print(f"the server's RSS grew {grown / 2**20:.2f} MB after {hellos} HELLOs, "  # shown with pytest -s
          f"{second / 2**20:.2f} MB of it in the second half")
    open(os.path.join(c.tmp, "go"), "w").close()
    codes, scodes, sched = c.wait_all(120)
    assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()
    for r, res in c.results().items():  # every sum exact, before and after the flood
        assert res.get("value") == {"before": True, "after": True, "after_i": True}, (r, res, c.all_logs())
    assert second < 4 << 20, f"the server grew {second / 2**20:.1f} MB with the second half of {hellos} HELLOs"
    assert grown < 32 << 20, f"the server grew {grown / 2**20:.1f} MB after {hellos} HELLOs"
    log = c.log("server0")
    took = re.search(r"(\d+) messages forwarded to Python", log)
    assert took and int(took.group(1)) >= hellos, log[-3000:]  # every HELLO reached the gate
    assert log.count("WARNING") < 30, log[-3000:]
