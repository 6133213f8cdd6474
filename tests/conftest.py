"""Test harness: real scheduler, server and worker processes on 127.0.0.1.

``cluster`` starts a scheduler (random port) and servers; ``Cluster.run_workers`` starts worker
processes that run a scenario from tests/scenarios.py and write their results as JSON. Every
process is killed and reaped at teardown, and each wait is bounded.
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "scenarios.py")

#: fast failure detection for tests (real clusters use the defaults in docs/env.md)
FAST_ENV = {"BYTEPS_HEARTBEAT_INTERVAL": "0.2", "BYTEPS_HEARTBEAT_TIMEOUT": "3", "BYTEPS_TIMEOUT": "30",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            # every test job authenticates its connections, as bpslaunch jobs do
            "BYTEPS_JOB_SECRET": "test-secret-0123456789abcdef"}


class Cluster:
    def __init__(self, tmp_path, workers, servers, local_size=1, env=None):
        self.tmp = tmp_path
        self.num_machines = workers
        self.num_servers = servers
        self.local_size = local_size
        self.env = {**os.environ, **FAST_ENV, **(env or {})}
        self.env.update(DMLC_NUM_WORKER=str(workers), DMLC_NUM_SERVER=str(servers), DMLC_PS_ROOT_URI="127.0.0.1",
                        DMLC_NODE_HOST="127.0.0.1", BYTEPS_JOB_ID=f"test-{os.getpid()}-{id(self)}")
        self.env.pop("DMLC_ROLE", None)
        self.scheduler = None
        self.servers = []
        self.workers = []
        self.port = None

    def _spawn(self, argv, role, extra=None, log=None):
        env = dict(self.env, DMLC_ROLE=role, **(extra or {}))
        out = open(os.path.join(self.tmp, log), "wb")
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def start(self, servers=True):
        port_file = os.path.join(self.tmp, "port")
        self.scheduler = self._spawn([sys.executable, "-m", "byteps.scheduler"], "scheduler",
                                     {"DMLC_PS_ROOT_PORT": "0", "BYTEPS_SCHEDULER_PORT_FILE": port_file},
                                     log="scheduler.log")
        deadline = time.monotonic() + 20
        while not os.path.exists(port_file):
            assert self.scheduler.poll() is None, self.log("scheduler")
            assert time.monotonic() < deadline, "scheduler did not write its port"
            time.sleep(0.02)
        self.port = int(open(port_file).read())
        self.env["DMLC_PS_ROOT_PORT"] = str(self.port)
        if servers:
            for i in range(self.num_servers):
                self.start_server(i)
        return self

    def start_server(self, i):
        self.servers.append(self._spawn([sys.executable, "-m", "byteps.server"], "server", log=f"server{i}.log"))

    def run_workers(self, scenario, args=None, env=None, machines=None):
        """Start every worker process (or those of `machines`) running `scenario`."""
        args = json.dumps(args or {})
        for wid in (range(self.num_machines) if machines is None else machines):
            for lr in range(self.local_size):
                extra = {"DMLC_WORKER_ID": str(wid), "BYTEPS_LOCAL_RANK": str(lr),
                         "BYTEPS_LOCAL_SIZE": str(self.local_size), **(env or {})}
                argv = [sys.executable, SCENARIOS, scenario, str(self.tmp), args]
                self.workers.append(self._spawn(argv, "worker", extra, log=f"worker{wid}.{lr}.log"))
        return self.workers

    def wait_workers(self, timeout=60):
        """Wait for every worker; return their exit codes. Fails the test with the logs on a time-out."""
        deadline = time.monotonic() + timeout
        for p in self.workers:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"workers did not finish within {timeout} s\n{self.all_logs()}")
        return [p.returncode for p in self.workers]

    def wait_all(self, timeout=30):
        codes = self.wait_workers(timeout)
        deadline = time.monotonic() + timeout
        for p in [*self.servers, self.scheduler]:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"servers/scheduler did not exit after the workers\n{self.all_logs()}")
        return codes, [p.returncode for p in self.servers], self.scheduler.returncode

    def results(self):
        out = {}
        for name in os.listdir(self.tmp):
            if name.startswith("result.") and name.endswith(".json"):
                with open(os.path.join(self.tmp, name)) as f:
                    res = json.load(f)
                out[res["rank"]] = res
        return out

    def log(self, name):
        path = os.path.join(self.tmp, f"{name}.log")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def all_logs(self):
        names = sorted(n[:-4] for n in os.listdir(self.tmp) if n.endswith(".log"))
        return "\n".join(f"----- {n}\n{self.log(n)[-3000:]}" for n in names)

    def kill_all(self):
        procs = [p for p in [self.scheduler, *self.servers, *self.workers] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(10)


class Run:
    """One cluster job running one scenario to completion; ``value(rank)`` fails the test with the
    logs if any worker failed. Module-scoped fixtures share one Run between many small tests."""

    def __init__(self, tmp, scenario, n, k, args=None, env=None, timeout=150):
        self.n, self.k = n, k
        self.c = Cluster(str(tmp), n, k, env=env).start()
        try:
            self.c.run_workers(scenario, args or {})
            self.codes, self.server_codes, self.sched_code = self.c.wait_all(timeout)
            self.res = self.c.results()
        finally:
            self.c.kill_all()

    def value(self, rank, section=None):
        assert self.codes == [0] * self.n, f"worker exit codes {self.codes}\n{self.c.all_logs()}"
        assert rank in self.res, f"no result from rank {rank}\n{self.c.all_logs()}"
        assert "error" not in self.res[rank], f"rank {rank}: {self.res[rank]['error']}\n{self.c.all_logs()}"
        v = self.res[rank]["value"]
        return v if section is None else v[section]

    def values(self, section=None):
        return [self.value(r, section) for r in range(self.n)]


def server_data_port(pid, wait=20.0):
    """The ZeroMQ data port of the server process ``pid``: of its listening TCP ports, the one that
    greets a new connection with ZMTP's signature (0xFF first); its direct-link listener
    (core/transport/bps_link.h) says nothing until spoken to."""
    import psutil

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        ports = sorted(c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
                       if c.status == psutil.CONN_LISTEN)
        for port in ports:
            try:  # a listener on another address (UCX's) refuses us on 127.0.0.1
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    if s.recv(1) == b"\xff":
                        return port
            except OSError:  # refused, or no greeting: a link listener
                pass
        time.sleep(0.1)
    raise AssertionError(f"server {pid} listens on no ZeroMQ port")


def member_dealer(ctx, port):
    """A DEALER to a server's data port that has passed the job's handshake (core/auth.py), as a
    worker's has: (socket, identity). Messages sent at once are held until the AUTH is checked."""
    import zmq

    from byteps.core import auth, wire

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    ident = auth.new_identity()
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.connect(f"tcp://127.0.0.1:{port}")
    knock = auth.Knock(FAST_ENV["BYTEPS_JOB_SECRET"].encode(), ident)
    sock.send_multipart(wire.control(wire.Cmd.HELLO, body=knock.hello()))
    assert sock.poll(20000), "no CHALLENGE"
    header, body = sock.recv_multipart()
    assert wire.unpack(header).cmd == wire.Cmd.CHALLENGE
    sock.send_multipart(wire.control(wire.Cmd.AUTH, body={"mac": knock.answer(wire.decode(body), "server")}))
    return sock, ident


def ask_link(sock):
    """Cmd.LINK on an authenticated DEALER (member_dealer): the server's decoded answer."""
    from byteps.core import wire

    sock.send_multipart(wire.control(wire.Cmd.LINK))
    assert sock.poll(20000), "no answer to LINK"
    header, body = sock.recv_multipart()
    assert wire.unpack(header).cmd == wire.Cmd.LINK
    return wire.decode(body)


class MemberLink:
    """A job member's direct link to a server (core/transport/bps_link.h), used as tests use a DEALER:
    ``send_multipart(frames)`` sends one message, ``recv_multipart()`` reads one whole message (blocking,
    up to ``timeout`` s), ``poll(timeout_ms)`` is True once bytes of a message are readable, ``close()``.
    Messages carry no identity frame: [header, body...] both ways; the server takes them as coming from
    ``identity``, the authenticated DEALER's (``dealer``, kept open for as long as the link is)."""

    def __init__(self, dealer, identity, sock):
        self.dealer, self.identity, self.sock = dealer, identity, sock

    def send_multipart(self, frames):
        from byteps.core import transport

        self.sock.sendall(transport.link_pack([bytes(f) for f in frames]))

    def recv_multipart(self):
        """One whole message, read exactly (nothing is buffered here: poll() sees what is left)."""
        from byteps.core import transport, wire

        return transport.link_recv(self.sock, max_frame=wire.MAX_BODY)

    def poll(self, timeout_ms=0):
        return bool(select.select([self.sock], [], [], max(0, timeout_ms) / 1000)[0])

    def close(self):
        self.sock.close()
        self.dealer.close(linger=0)


def member_link(ctx, port, timeout=30.0):
    """An authenticated job member's direct link to the server whose ZeroMQ data port is ``port``, as a
    worker opens it (member_dealer, Cmd.LINK, the token on a new TCP connection): a MemberLink. Data
    messages (PUSHPULL, BROADCAST, ASYNC_PUSHPULL, RESULT) go on it; ZeroMQ carries only control."""
    from byteps.core import transport

    dealer, ident = member_dealer(ctx, port)
    answer = ask_link(dealer)
    assert "token" in answer, answer
    fd = transport.open_link("127.0.0.1", answer["port"], bytes.fromhex(answer["token"]), ident, 0, timeout)
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.settimeout(timeout)
    return MemberLink(dealer, ident, sock)


def memfd_arenas(pid):
    """byteps memfd arenas a process holds open (they show as /memfd:byteps-... links)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:byteps"):
            out.append(target)
    return out


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(workers, servers, local_size=1, env=None, start=True, subdir=None):
        where = tmp_path
        if subdir is not None:
            where = tmp_path / subdir
            where.mkdir()
        c = Cluster(where, workers, servers, local_size, env)
        made.append(c)
        return c.start() if start else c

    yield make
    for c in made:
        c.kill_all()
