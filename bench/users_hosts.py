"""bench_users.py's jobs on hosts built as Linux network namespaces (bench/netns.py): every byte
between hosts crosses a TCP stack and a veth, unshaped or at a set rate (tc tbf), as between machines.

Layout of a job: ``n`` worker hosts ``w0..``, each running one worker process and one colocated
Summation Service server (k = 0, the design's default placement), ``k`` extra hosts ``x0..`` with a
standalone server each, and a host of its own for the scheduler. Every host's processes are started
by ``bpslaunch`` in role mode (``DMLC_ROLE``), as on real machines; gloo's process group (the
baseline, in the same worker processes) reaches its peers over the same links.

CPU by role: while the job runs, the driver samples the cumulative CPU time (user + system) of every
process the job's launchers started, twice a second, and keeps each process's last reading, so the
job's CPU seconds per role (worker, server, scheduler, launcher) survive the processes' exit.

Needs root. The namespaces are always removed: netns.Network kills every process inside them and
deletes them on any exit (normal, exception, Ctrl-C, SIGTERM), and deletes those of a run that was
SIGKILLed at the next start.
"""
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import netns

SCHED_PORT = 9000  #: fixed ports are fine inside our own namespaces
GLOO_PORT = 29500
RTT_PORT = 29600
SERVER_PIDS = "server-pids"  #: file in the job's folder: the servers' pids, for the workers' CPU counts


def _role(cmdline):
    text = " ".join(cmdline)
    if "byteps.server" in text:
        return "server"
    if "byteps.scheduler" in text:
        return "scheduler"
    if "--worker" in cmdline:
        return "worker"
    return "launcher"


class CpuByRole:
    """Samples the CPU seconds of every process the job's launchers started (and of the launchers)
    every ``every`` s, keeping each process's last reading."""

    def __init__(self, procs, every=0.5):
        self.procs, self.every = procs, every  # procs: the driver's (tag, Popen) list, which grows
        self.last = {}  # pid -> (role, cpu seconds at the last reading)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self):
        import psutil

        for _, popen in list(self.procs):
            try:
                top = psutil.Process(popen.pid)
                tree = [top] + top.children(recursive=True)
            except psutil.Error:
                continue
            for proc in tree:
                try:
                    cpu = proc.cpu_times()
                    role = self.last[proc.pid][0] if proc.pid in self.last else _role(proc.cmdline())
                    self.last[proc.pid] = (role, cpu.user + cpu.system)
                except psutil.Error:
                    pass

    def _loop(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def totals(self):
        out = {}
        for role, cpu in self.last.values():
            out[role] = out.get(role, 0.0) + cpu
        return out


def run(script, worker_argv, env, n, k=0, rate_mbit=None, timeout=1800, launcher=None, around=None):
    """Run one job on ``n`` worker hosts and ``k`` server hosts; returns (the JSON rank 0 wrote,
    CPU seconds by role, namespaces still there after the network closed: should be none).

    ``worker_argv(out, master)`` gives the worker's arguments after ``script``; ``env`` is the
    environment of every process (the driver's default environment), ``launcher`` bpslaunch's argv.
    ``around(net)``, if given, runs on the network before the job starts and after its workers end;
    its two results go into the returned JSON as ``around``."""
    import json

    workers = [f"w{i}" for i in range(n)]
    extras = [f"x{j}" for j in range(k)]
    rundir = tempfile.mkdtemp(prefix="bench-users-hosts-")
    out = os.path.join(rundir, "result.json")
    try:
        with netns.Network(workers + extras + ["sched"], rate_mbit=rate_mbit or None) as net:
            base = dict(env, DMLC_NUM_WORKER=str(n), DMLC_NUM_SERVER=str(n + k), DMLC_PS_ROOT_URI=net.addr["sched"],
                        DMLC_PS_ROOT_PORT=str(SCHED_PORT), BYTEPS_JOB_SECRET=secrets.token_hex(16),
                        GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1",
                        BENCH_SERVER_PIDS=os.path.join(rundir, SERVER_PIDS))
            procs, logs = [], []

            def start(host, tag, role, argv, extra=None):
                log = open(os.path.join(rundir, f"{tag}.log"), "wb")
                logs.append((tag, log.name))
                e = dict(base, DMLC_ROLE=role, DMLC_NODE_HOST=net.addr[host], **(extra or {}))
                procs.append((tag, net.popen(host, [*launcher, *argv], env=e, stdout=log, stderr=subprocess.STDOUT)))
                log.close()

            def tails():
                text = []
                for tag, path in logs:
                    with open(path, errors="replace") as f:
                        text.append(f"----- {tag}\n{f.read()[-1500:]}")
                return "\n".join(text)

            seen = [around(net)] if around else []
            with CpuByRole(procs) as cpu:
                start("sched", "scheduler", "scheduler", [])
                for i, h in enumerate(workers + extras):
                    start(h, f"server{i}", "server", [])
                _write_server_pids(base["BENCH_SERVER_PIDS"], [p for t, p in procs if t.startswith("server")])
                wargv = ["--", sys.executable, script, *worker_argv(out, net.addr["w0"])]
                for i, h in enumerate(workers):
                    start(h, f"worker{i}", "worker", wargv, {"DMLC_WORKER_ID": str(i)})
                deadline = time.monotonic() + timeout
                wprocs = [(t, p) for t, p in procs if t.startswith("worker")]
                while any(p.poll() is None for _, p in wprocs):
                    bad = [(t, p.returncode) for t, p in procs if p.poll() not in (None, 0)]
                    if bad:
                        raise SystemExit(f"job on {n}+{k} hosts failed: {bad}\n{tails()}")
                    if time.monotonic() > deadline:
                        raise SystemExit(f"job on {n}+{k} hosts did not finish within {timeout} s\n{tails()}")
                    time.sleep(0.2)
                if not os.path.exists(out):
                    raise SystemExit(f"job on {n}+{k} hosts wrote no result\n{tails()}")
                for _, p in procs:  # servers and scheduler end once every worker has left; else close() kills them
                    try:
                        p.wait(15)
                    except subprocess.TimeoutExpired:
                        pass
            if around:
                seen.append(around(net))
        with open(out) as f:
            res = json.load(f)
        res["around"] = seen
        return res, cpu.totals(), net.exists()
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


def _write_server_pids(path, launchers, timeout=30):
    """The pids of the server processes the ``launchers`` (bpslaunch in role mode) started, one a line."""
    import psutil

    deadline = time.monotonic() + timeout
    pids = []
    while time.monotonic() < deadline:
        pids = []
        for p in launchers:
            try:
                pids += [c.pid for c in psutil.Process(p.pid).children(recursive=True)
                         if "byteps.server" in " ".join(c.cmdline())]
            except psutil.Error:
                pass
        if len(pids) >= len(launchers):
            break
        time.sleep(0.05)
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(map(str, pids)))
    os.replace(path + ".tmp", path)


def server_pids(timeout=30):
    """In a worker of a hosts job: the pids of every server of the job (they share this PID namespace)."""
    path = os.environ.get("BENCH_SERVER_PIDS")
    if not path:
        return None
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return []
        time.sleep(0.05)
    with open(path) as f:
        return [int(x) for x in f.read().split()]
