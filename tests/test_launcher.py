"""bpslaunch end-to-end: real processes, no fixed ports, every test time-bounded.

Role-mode tests need only the launcher. Local-mode mechanics run with stub scheduler and
server scripts (substituted through SCHEDULER_ARGV/SERVER_ARGV); the tests against the real
`byteps.scheduler` / `byteps.server` skip until those modules exist.
"""
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

LAUNCH = [sys.executable, "-m", "byteps.launcher"]


def _has_module(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


HAVE_SERVICES = _has_module("byteps.scheduler.__main__") and _has_module("byteps.server.__main__")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra):
    """Our environment without any DMLC_*/BYTEPS_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def worker_env(local_size=3, **extra):
    """A valid role-mode worker environment (the port is never connected to)."""
    env = dict(DMLC_ROLE="worker", DMLC_NUM_WORKER=1, DMLC_NUM_SERVER=1, DMLC_WORKER_ID=0,
               DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=free_port(), BYTEPS_LOCAL_SIZE=local_size)
    env.update(extra)
    return clean_env(**env)


def launch(args, env, timeout=30):
    return subprocess.run(LAUNCH + list(args), env=env, capture_output=True, text=True, timeout=timeout)


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def read_pids(d, names, timeout=15.0):
    """Wait for pid files `names` in directory `d`; return their pids."""
    deadline = time.monotonic() + timeout
    while True:
        if all((d / n).exists() for n in names):
            return [int((d / n).read_text()) for n in names]
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    raise AssertionError(f"pid files {names} not all written in {timeout}s: {sorted(os.listdir(d))}")


# A local rank that records its pid (atomically), optionally starts a grandchild and
# records that pid too, then behaves as argv says: "sleep", "exit:R:N" (rank R exits N once
# every rank has written its pid), "kill" (SIGKILLs itself), "leave" (exits 0 at once) or
# "stubborn" (ignores SIGTERM, then sleeps).
RANK = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    d, action = sys.argv[1], sys.argv[2]
    rank = os.environ["BYTEPS_LOCAL_RANK"]
    def record(name, pid):
        tmp = os.path.join(d, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(pid))
        os.rename(tmp, os.path.join(d, name))
    if "grandchild" in sys.argv:
        g = subprocess.Popen(["sleep", "1000"], start_new_session=(action == "leave"))
        record(f"grand.{rank}", g.pid)
    record(f"pid.{rank}", os.getpid())
    if action.startswith("exit") and rank == action.split(":")[1]:
        want = int(os.environ["BYTEPS_LOCAL_SIZE"])
        while len([n for n in os.listdir(d) if n.startswith("pid.") and not n.endswith(".tmp")]) < want:
            time.sleep(0.02)
        sys.exit(int(action.split(":")[2]))
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "leave":
        sys.exit(0)
    if action == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1000)
""")


@pytest.fixture
def rank_script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return [sys.executable, str(path), str(tmp_path)]


# ---------------------------------------------------------------------------------------
# Role mode: worker


# One write() per line: with --no-prefix the ranks share our stdout, and print() with
# several arguments (unbuffered) would interleave word by word.
PRINT_RANK = [sys.executable, "-c",
              "import os, sys; r = os.environ['BYTEPS_LOCAL_RANK'];"
              " sys.stdout.write(f\"rank {r} {os.environ['BYTEPS_LOCAL_SIZE']}\\n\");"
              " sys.stderr.write(f'err {r}\\n')"]


@pytest.mark.timeout(30)
def test_worker_ranks_and_prefixes():
    r = launch(PRINT_RANK, worker_env(3))
    assert r.returncode == 0, r.stderr
    for j in range(3):
        assert f"[worker 0.{j}] rank {j} 3\n" in r.stdout
        assert f"[worker 0.{j}] err {j}\n" in r.stderr
    assert "err" not in r.stdout and "rank" not in r.stderr


@pytest.mark.timeout(30)
def test_single_quoted_command_runs_through_a_shell():
    """BytePS's docs write ``bpslaunch "python3 train.py"``: one string, run by /bin/sh -c."""
    line = (f"{sys.executable} -c \"import os, sys; sys.stdout.write('rank ' + os.environ['BYTEPS_LOCAL_RANK'] + "
            "'\\n')\" && echo \"shell $BYTEPS_LOCAL_SIZE\"")
    r = launch([line], worker_env(2))
    assert r.returncode == 0, r.stderr
    for j in range(2):
        assert f"[worker 0.{j}] rank {j}\n" in r.stdout and f"[worker 0.{j}] shell 2\n" in r.stdout


@pytest.mark.timeout(30)
def test_no_prefix_passes_output_through():
    r = launch(["--no-prefix", "--"] + PRINT_RANK, worker_env(3))
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["rank 0 3", "rank 1 3", "rank 2 3"]
    assert "[worker" not in r.stdout + r.stderr


@pytest.mark.timeout(30)
def test_local_size_from_visible_devices():
    env = worker_env(3)
    del env["BYTEPS_LOCAL_SIZE"]
    env["NVIDIA_VISIBLE_DEVICES"] = "0,1"
    r = launch(PRINT_RANK, env)
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines()) == ["[worker 0.0] rank 0 2", "[worker 0.1] rank 1 2"]


@pytest.mark.timeout(30)
def test_all_output_drained():
    n = 20000
    cmd = [sys.executable, "-c", f"import sys\nfor i in range({n}): print(i)\nsys.stdout.write('tail')"]
    r = launch(cmd, worker_env(1))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == n + 1 and lines[-2] == f"[worker 0.0] {n - 1}" and lines[-1] == "[worker 0.0] tail"


@pytest.mark.timeout(30)
def test_first_failure_stops_the_job(rank_script, tmp_path):
    t0 = time.monotonic()
    r = launch(rank_script + ["exit:1:3"], worker_env(3))
    assert r.returncode == 3, r.stderr
    assert time.monotonic() - t0 < 15
    assert "worker 0.1 (pid" in r.stderr and "exited with code 3; stopping the job" in r.stderr
    pids = read_pids(tmp_path, ["pid.0", "pid.1", "pid.2"], timeout=0)
    assert wait_dead(pids, 1.0) == []


@pytest.mark.timeout(30)
def test_child_killed_by_signal_gives_128_plus_n(rank_script):
    r = launch(rank_script + ["kill"], worker_env(1))
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    assert "SIGKILL" in r.stderr


@pytest.mark.timeout(30)
def test_missing_command_is_127():
    r = launch(["/nonexistent/program-xyz"], worker_env(2))
    assert r.returncode == 127
    assert "/nonexistent/program-xyz" in r.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_children(rank_script, tmp_path, sig, code):
    p = subprocess.Popen(LAUNCH + rank_script + ["sleep"], env=worker_env(3),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = read_pids(tmp_path, ["pid.0", "pid.1", "pid.2"])
        p.send_signal(sig)
        out, err = p.communicate(timeout=15)
    finally:
        p.kill()
    assert p.returncode == code, err
    assert f"received {signal.Signals(sig).name}" in err
    assert wait_dead(pids, 1.0) == []


@pytest.mark.timeout(30)
def test_sigkill_of_launcher_kills_children(rank_script, tmp_path):
    p = subprocess.Popen(LAUNCH + rank_script + ["sleep"], env=worker_env(2),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = read_pids(tmp_path, ["pid.0", "pid.1"])
        p.kill()
        p.wait(timeout=5)
        assert wait_dead(pids, 5.0) == [], "PDEATHSIG did not end the children"
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_timeout_kills_grandchildren(rank_script, tmp_path):
    t0 = time.monotonic()
    r = launch(["--timeout", "2", "--"] + rank_script + ["sleep", "grandchild"], worker_env(2))
    assert r.returncode == 124, r.stderr
    assert "--timeout 2s expired" in r.stderr
    assert time.monotonic() - t0 < 15
    pids = read_pids(tmp_path, ["pid.0", "pid.1", "grand.0", "grand.1"], timeout=0)
    assert wait_dead(pids, 1.0) == []


@pytest.mark.timeout(30)
def test_sigterm_ignored_then_sigkill(rank_script, tmp_path):
    r = launch(["--timeout", "0.5", "--"] + rank_script + ["stubborn"], worker_env(1))
    assert r.returncode == 124, r.stderr
    assert "still alive 5s after SIGTERM" in r.stderr
    (pid,) = read_pids(tmp_path, ["pid.0"], timeout=0)
    assert wait_dead([pid], 1.0) == []


@pytest.mark.timeout(30)
def test_orphaned_grandchild_is_killed(rank_script, tmp_path):
    # The rank starts a detached `sleep` in its own session and exits 0 at once: the
    # sleeper is an orphan, and bpslaunch (as subreaper) must still end it.
    r = launch(rank_script + ["leave", "grandchild"], worker_env(1))
    assert r.returncode == 0, r.stderr
    (grand,) = read_pids(tmp_path, ["grand.0"], timeout=0)
    assert wait_dead([grand], 1.0) == []


# ---------------------------------------------------------------------------------------
# Role mode: configuration errors and services


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name, value", [
    ("DMLC_ROLE", "bogus"),
    ("DMLC_NUM_WORKER", "abc"),
    ("DMLC_NUM_SERVER", None),
    ("DMLC_WORKER_ID", "7"),
    ("BYTEPS_LOG_LEVEL", "LOUD"),
])
def test_bad_environment_exits_2(name, value):
    env = worker_env(2)
    if value is None:
        del env[name]
    else:
        env[name] = value
    r = launch(PRINT_RANK, env)
    assert r.returncode == 2
    assert name in r.stderr
    assert r.stdout == ""


@pytest.mark.timeout(30)
def test_worker_without_command_exits_2():
    r = launch([], worker_env(1))
    assert r.returncode == 2 and "command" in r.stderr


@pytest.mark.timeout(30)
def test_usage_errors_exit_2():
    assert launch(["--local", "--", "true"], clean_env()).returncode == 2  # no --workers
    assert launch(["--workers", "2", "true"], clean_env()).returncode == 2  # not --local
    assert launch(["--local", "--workers", "0", "--", "true"], clean_env()).returncode == 2
    r = launch(["--join", "10.0.0.1"], clean_env())  # no port
    assert r.returncode == 2 and "expected the scheduler's HOST:PORT" in r.stderr, r.stderr
    r = launch(["--join", "10.0.0.1:9000", "--local", "--workers", "1", "--", "true"], clean_env())
    assert r.returncode == 2 and "different modes" in r.stderr, r.stderr


def _stubbed(args):
    """Run main(args) in a fresh interpreter with stub scheduler/server commands."""
    code = textwrap.dedent("""
        import json, sys
        import byteps.launcher as L
        stubs = json.loads(sys.argv[1])
        L.SCHEDULER_ARGV, L.SERVER_ARGV = stubs["scheduler"], stubs["server"]
        sys.exit(L.main(sys.argv[2:]))
    """)
    return [sys.executable, "-c", code] + args


# A stub service: records its environment, then (scheduler) binds a free port and
# publishes it the way byteps.scheduler does, then behaves as argv says.
SERVICE = textwrap.dedent("""
    import json, os, socket, sys, time
    d, behaviour = sys.argv[1], sys.argv[2]
    role = os.environ["DMLC_ROLE"]
    name = role + ("" if role == "scheduler" else "." + str(os.getpid()))
    with open(os.path.join(d, name + ".json"), "w") as f:
        json.dump(dict(os.environ, pid=os.getpid()), f)
    if behaviour == "fail":
        print("stub", role, "fails", file=sys.stderr)
        sys.exit(5)
    if role == "scheduler":
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        path = os.environ["BYTEPS_SCHEDULER_PORT_FILE"]
        with open(path + ".tmp", "w") as f:
            f.write(f"{s.getsockname()[1]}\\n")
        os.rename(path + ".tmp", path)
    print("stub", role, "up")
    time.sleep(1.0 if behaviour == "ok" else 1000)
""")

# A worker that records its environment and exits 0.
RECORD_WORKER = [sys.executable, "-c", textwrap.dedent("""
    import json, os, sys
    e = os.environ
    with open(os.path.join(sys.argv[1], f"worker.{e['DMLC_WORKER_ID']}.{e['BYTEPS_LOCAL_RANK']}.json"), "w") as f:
        json.dump(dict(e), f)
    print("hello from", e["DMLC_WORKER_ID"], e["BYTEPS_LOCAL_RANK"])
""")]


def stub_services(tmp_path, scheduler="ok", server="ok"):
    path = tmp_path / "service.py"
    path.write_text(SERVICE)
    return json.dumps({"scheduler": [sys.executable, str(path), str(tmp_path), scheduler],
                       "server": [sys.executable, str(path), str(tmp_path), server]})


def load_json(tmp_path, prefix):
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob(prefix + "*.json"))]


@pytest.mark.timeout(30)
def test_role_mode_runs_the_service(tmp_path):
    env = worker_env(1, DMLC_ROLE="server")
    r = subprocess.run(_stubbed([stub_services(tmp_path), "ignored", "args"]), env=env,
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    assert "ignores the command" in r.stderr
    assert "[server] stub server up" in r.stdout
    (rec,) = load_json(tmp_path, "server")
    assert rec["DMLC_ROLE"] == "server" and rec["PYTHONUNBUFFERED"] == "1"


# ---------------------------------------------------------------------------------------
# Local mode with stub services


@pytest.mark.timeout(30)
def test_local_mode_environment(tmp_path):
    args = [stub_services(tmp_path), "--local", "--workers", "2", "--servers", "2", "--local-size", "2",
            "--"] + RECORD_WORKER + [str(tmp_path)]
    r = subprocess.run(_stubbed(args), env=clean_env(), capture_output=True, text=True, timeout=25)
    assert r.returncode == 0, r.stderr
    (sched,) = load_json(tmp_path, "scheduler")
    servers = load_json(tmp_path, "server")
    workers = load_json(tmp_path, "worker")
    assert sched["DMLC_PS_ROOT_PORT"] == "0"
    assert not os.path.exists(os.path.dirname(sched["BYTEPS_SCHEDULER_PORT_FILE"])), "tmpdir not removed"
    assert len(servers) == 2 and len(workers) == 4
    port = {e["DMLC_PS_ROOT_PORT"] for e in servers + workers}
    assert len(port) == 1 and int(port.pop()) > 0
    assert {(e["DMLC_WORKER_ID"], e["BYTEPS_LOCAL_RANK"]) for e in workers} == {
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}
    job_ids = {e["BYTEPS_JOB_ID"] for e in [sched] + servers + workers}
    assert len(job_ids) == 1 and job_ids.pop().startswith("bps-")
    for e in [sched] + servers + workers:
        assert e["DMLC_NUM_WORKER"] == "2" and e["DMLC_NUM_SERVER"] == "2"
        assert e["DMLC_PS_ROOT_URI"] == "127.0.0.1" and e["DMLC_NODE_HOST"] == "127.0.0.1"
        assert e["PYTHONUNBUFFERED"] == "1"
    assert {e["DMLC_ROLE"] for e in servers} == {"server"}
    assert {e["DMLC_ROLE"] for e in workers} == {"worker"}
    assert {e["BYTEPS_LOCAL_SIZE"] for e in workers} == {"2"}
    assert {e["CUDA_DEVICE_ORDER"] for e in workers} == {"PCI_BUS_ID"}  # GPU i is PCIe/NVML GPU i
    assert "[scheduler] stub scheduler up" in r.stdout
    assert "[server 0] stub server up" in r.stdout and "[server 1] stub server up" in r.stdout
    assert "[worker 1.1] hello from 1 1" in r.stdout


@pytest.mark.timeout(30)
def test_local_mode_scheduler_fails_before_port(tmp_path):
    args = [stub_services(tmp_path, scheduler="fail"), "--local", "--workers", "1", "--"] + RECORD_WORKER + [
        str(tmp_path)]
    r = subprocess.run(_stubbed(args), env=clean_env(), capture_output=True, text=True, timeout=25)
    assert r.returncode == 5
    assert "[scheduler] stub scheduler fails" in r.stderr
    assert "before writing its port" in r.stderr
    assert load_json(tmp_path, "worker") == [] and load_json(tmp_path, "server") == []


@pytest.mark.timeout(30)
def test_local_mode_grace_then_terminate(tmp_path):
    args = [stub_services(tmp_path, scheduler="hang", server="hang"), "--local", "--workers", "1",
            "--grace", "0.5", "--"] + RECORD_WORKER + [str(tmp_path)]
    r = subprocess.run(_stubbed(args), env=clean_env(), capture_output=True, text=True, timeout=25)
    assert r.returncode == 0, r.stderr
    assert "still running 0.5s after the workers finished" in r.stderr
    pids = [e["pid"] for e in load_json(tmp_path, "scheduler") + load_json(tmp_path, "server")]
    assert len(pids) == 2 and wait_dead(pids, 1.0) == []


@pytest.mark.timeout(30)
def test_local_mode_server_failure_stops_workers(tmp_path, rank_script):
    args = [stub_services(tmp_path, server="fail"), "--local", "--workers", "2", "--"] + rank_script + ["sleep"]
    r = subprocess.run(_stubbed(args), env=clean_env(), capture_output=True, text=True, timeout=25)
    assert r.returncode == 5, r.stderr
    # both servers fail at once: whichever bpslaunch sees first is named
    assert re.search(r"server [01] \(pid \d+\) exited with code 5; stopping the job", r.stderr), r.stderr
    pids = [int(p.read_text()) for p in tmp_path.glob("pid.*") if not p.name.endswith(".tmp")]
    assert wait_dead(pids, 1.0) == []


# ---------------------------------------------------------------------------------------
# Local mode with the real scheduler and servers


@pytest.mark.skipif(not HAVE_SERVICES, reason="byteps.scheduler / byteps.server not written yet")
@pytest.mark.timeout(60)
def test_local_mode_real_services_start():
    # The workers never join the job, so the services are ended after --grace; what is
    # checked is that the scheduler reports its port and every process gets its variables.
    check = textwrap.dedent("""
        import os
        e = os.environ
        assert int(e["DMLC_PS_ROOT_PORT"]) > 0
        print("ok", e["DMLC_WORKER_ID"], e["BYTEPS_LOCAL_RANK"], e["DMLC_PS_ROOT_PORT"])
    """)
    r = launch(["--local", "--workers", "2", "--servers", "1", "--local-size", "2", "--grace", "2",
                "--timeout", "45", "--", sys.executable, "-c", check], clean_env(), timeout=55)
    assert r.returncode == 0, r.stdout + r.stderr
    oks = [line.split()[3:] for line in r.stdout.splitlines() if "] ok " in line]
    assert sorted((w, l) for w, l, _ in oks) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert len({p for _, _, p in oks}) == 1


@pytest.mark.skipif(not HAVE_SERVICES, reason="byteps.scheduler / byteps.server not written yet")
@pytest.mark.timeout(60)
def test_local_mode_real_job_completes():
    # A whole job: the workers join, meet at a barrier and shut down; the scheduler and
    # servers then exit 0 on their own, well inside --grace.
    job = "import byteps as b; b.init(); print('rank', b.rank(), 'of', b.size()); b.barrier(); b.shutdown()"
    t0 = time.monotonic()
    r = launch(["--local", "--workers", "2", "--servers", "2", "--local-size", "2", "--grace", "20",
                "--timeout", "45", "--", sys.executable, "-c", job], clean_env(), timeout=55)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = sorted(line.split()[3] for line in r.stdout.splitlines() if "] rank " in line)
    assert ranks == ["0", "1", "2", "3"]
    assert "still running" not in r.stderr
    assert time.monotonic() - t0 < 30
