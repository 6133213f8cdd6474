"""Kill stress: SIGKILL one scheduler, server or worker at a random moment of a running job.

Each trial starts a real job (scheduler, 2 servers, 2 worker processes: either two machines of one
process or one machine of two processes reducing locally), lets every worker check a few exact
push_pull steps (tests/scenarios_stress.py::stress_loop), then kills one process chosen at random,
after a random delay. Every survivor must then, within a bound derived from the heartbeat
time-out:

* name the lost peer: workers raise ``PeerLostError`` in the training script ("lost server 1
  (..., pid P ...)", "lost worker rank 1 (... pid P ...)", "lost the scheduler"), servers and the
  scheduler log it and exit 1;
* leave nothing behind: every process of the job (and any child) has exited, no memfd arena or
  listening socket of the job is held by anyone, the job never had a /dev/shm file open or mapped
  (byteps uses memfd arenas, which the kernel frees with their last holder), and the test process
  itself holds no more file descriptors than before.

``bpslaunch --local`` trials kill one of its children instead: bpslaunch must report the victim,
exit 137 (128 + SIGKILL) and take every other process down.

Every choice of a trial (layout, transport, partition size, victim, delay) comes from its seed,
which is in the test id (``test_kill_stress[server-3]`` has seed ``seed_of("server", 3)``) and is
printed; ``pytest -m slow 'tests/test_stress.py::test_kill_stress[server-3]'`` replays it.
The default suite runs one trial per role (``test_kill_quick``) and one through bpslaunch;
``-m slow`` runs 20 per role plus 10 through bpslaunch.
"""
import os
import random
import signal
import subprocess
import sys
import time
import zlib

import psutil
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from conftest import FAST_ENV, SCENARIOS, memfd_arenas  # noqa: E402

#: heartbeats in these trials: a killed peer is noticed after HB_TIMEOUT seconds
HB_INTERVAL, HB_TIMEOUT = 0.2, 2.0
STRESS_ENV = {"BYTEPS_HEARTBEAT_INTERVAL": str(HB_INTERVAL), "BYTEPS_HEARTBEAT_TIMEOUT": str(HB_TIMEOUT),
              "BYTEPS_TIMEOUT": "20"}
#: survivors must be gone this long after the kill: detection, abort, shutdown, with slack for a
#: 2-core machine running five Python processes
SETTLE_S = HB_TIMEOUT + 10
ROLES = ("scheduler", "server", "worker")
SLOW_TRIALS = 20
LAUNCHER_TRIALS = 10


def seed_of(role, trial):
    return zlib.crc32(f"{role}-{trial}".encode())


def plan(role, seed):
    """Every random choice of one trial, from its seed."""
    rng = random.Random(seed)
    return {"role": role, "seed": seed,
            "layout": rng.choice(["2x1", "1x2"]),          # machines x processes per machine
            "ipc": rng.choice(["0", "1"]),                 # TCP or shared memory with the servers
            "partition": rng.choice([4096, 65536, 4096000]),
            "victim": rng.randrange(2),                    # which server / worker (the scheduler: only one)
            "delay": round(rng.uniform(0.0, 1.5), 3)}      # after every worker has checked a step


# ------------------------------------------------------------------------------ inspection helpers


def _tree(pids):
    """The processes `pids` and all their descendants (psutil objects)."""
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


def _listening_ports(procs):
    ports = set()
    for p in procs:
        try:
            ports |= {c.laddr.port for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    return ports


def _alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _memfd_holders(pids):
    """pid -> byteps memfd arenas it holds open, for every pid that still exists."""
    out = {}
    for pid in pids:
        names = memfd_arenas(pid)
        if names:
            out[pid] = names
    return out


def _dev_shm_users(procs):
    """/dev/shm files the processes hold open or mapped (byteps uses memfd arenas, never /dev/shm)."""
    used = set()
    for p in procs:
        try:
            used |= {f.path for f in p.open_files() if f.path.startswith("/dev/shm/")}
            used |= {m.path for m in p.memory_maps(grouped=True) if m.path.startswith("/dev/shm/")}
        except psutil.Error:
            pass
    return used


def _wait_progress(tmp, ranks, procs, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(tmp, f"progress.{r}")) for r in ranks):
            return True
        if any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.02)
    return False


def _assert_clean(trial, procs, ports, shm_used, fds_before, why):
    """Nothing of the job is left: processes, memfd arenas, listening sockets, /dev/shm entries, our fds.

    ``shm_used``: /dev/shm files the job's processes had open before the kill (expected: none). A
    plain before/after listing of /dev/shm would also see other jobs' files on a shared machine."""
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [f"{p.pid} {' '.join(p.cmdline()[-3:])}" for p in procs if _alive(p)]
    assert not left, f"{trial}: processes left running: {left}\n{why()}"
    held = _memfd_holders([p.pid for p in procs] + [os.getpid()])
    assert not held, f"{trial}: byteps memfd arenas still held: {held}"
    listening = {c.laddr.port for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port in ports and c.pid in {p.pid for p in procs}}
    assert not listening, f"{trial}: ports still listening: {listening}"
    assert not shm_used, f"{trial}: the job used /dev/shm files {shm_used}"
    left_shm = {path for path in shm_used if os.path.exists(path)}
    assert not left_shm, f"{trial}: /dev/shm files left behind: {left_shm}"
    fds = psutil.Process().num_fds()
    assert fds <= fds_before, f"{trial}: the test process holds {fds} fds, {fds_before} before the trial"


# ------------------------------------------------------------------------------ one trial, harness


def kill_trial(cluster, role, seed):
    """One trial on the conftest harness: processes started directly, every survivor inspected."""
    t = plan(role, seed)
    print(f"kill trial: {t}", flush=True)
    fds_before = psutil.Process().num_fds()
    machines, local = (2, 1) if t["layout"] == "2x1" else (1, 2)
    env = {**STRESS_ENV, "BYTEPS_ENABLE_IPC": t["ipc"], "BYTEPS_PARTITION_BYTES": str(t["partition"])}
    c = cluster(machines, 2, local_size=local, env=env)
    c.run_workers("stress_loop", {"seed": seed})
    assert _wait_progress(c.tmp, [0, 1], [c.scheduler, *c.servers, *c.workers]), \
        f"{t}: workers made no progress\n{c.all_logs()}"
    everyone = [c.scheduler, *c.servers, *c.workers]
    procs = _tree([p.pid for p in everyone])
    ports, shm_used = _listening_ports(procs), _dev_shm_users(procs)
    print(f"  {len(procs)} processes, listening on {sorted(ports)}", flush=True)
    time.sleep(t["delay"])
    victim = {"scheduler": c.scheduler, "server": c.servers[t["victim"] % 2],
              "worker": c.workers[t["victim"] % 2]}[role]
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for p in everyone:
        try:
            p.wait(max(0.1, killed_at + SETTLE_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{t}: {p.args[-3:]} still running {SETTLE_S} s after the kill\n{c.all_logs()}")
    assert victim.returncode == -signal.SIGKILL, f"{t}: the victim finished before the kill\n{c.all_logs()}"

    # what every survivor was told
    if role == "scheduler":
        said = "lost the scheduler"
    else:
        said = f"lost {role}"  # "lost server 1 (...)", "lost worker rank 1 (...)"
    pid_text = f"pid {victim.pid} "
    results = c.results()
    for w, p in enumerate(c.workers):
        if p is victim:
            continue
        assert p.returncode == 0, f"{t}: worker {w} exited {p.returncode}\n{c.all_logs()}"
        rank = w  # conftest starts them in (worker id, local rank) order, the scheduler's rank order
        assert rank in results and "value" in results[rank], f"{t}: no result from rank {rank}\n{c.all_logs()}"
        v = results[rank]["value"]
        assert v["error_type"] == "PeerLostError", f"{t}: rank {rank} got {v}\n{c.all_logs()}"
        assert said in v["error"], f"{t}: rank {rank}: {v['error']!r} does not say {said!r}"
        if role != "scheduler":
            assert pid_text in v["error"], f"{t}: rank {rank}: {v['error']!r} does not name {pid_text!r}"
    for i, p in enumerate(c.servers):
        if p is victim:
            continue
        assert p.returncode == 1, f"{t}: server {i} exited {p.returncode}\n{c.all_logs()}"
        assert said in c.log(f"server{i}"), f"{t}: server {i} log\n{c.log(f'server{i}')}"
    if role != "scheduler":
        assert c.scheduler.returncode == 1, f"{t}: scheduler exited {c.scheduler.returncode}\n{c.all_logs()}"
        assert said in c.log("scheduler") and pid_text in c.log("scheduler"), c.log("scheduler")
    _assert_clean(t, procs, ports, shm_used, fds_before, c.all_logs)
    return t


# ------------------------------------------------------------------------------ one trial, bpslaunch


def launcher_trial(tmp_path, seed):
    """One trial under ``bpslaunch --local``: kill one of its children, bpslaunch takes the rest down."""
    rng = random.Random(seed)
    role = rng.choice(ROLES)
    t = plan(role, seed)
    print(f"bpslaunch kill trial: {t}", flush=True)
    fds_before = psutil.Process().num_fds()
    local = 1 if t["layout"] == "2x1" else 2
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(FAST_ENV)
    env.pop("BYTEPS_JOB_SECRET")  # bpslaunch makes one
    env.update(STRESS_ENV, BYTEPS_ENABLE_IPC=t["ipc"], BYTEPS_PARTITION_BYTES=str(t["partition"]))
    argv = [sys.executable, "-m", "byteps.launcher", "--local", "--workers", str(2 // local), "--servers", "2",
            "--local-size", str(local), "--", sys.executable, SCENARIOS, "stress_loop", str(tmp_path),
            f'{{"seed": {seed}}}']
    out = open(tmp_path / "bpslaunch.log", "wb")
    launcher = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    log = lambda: (tmp_path / "bpslaunch.log").read_text(errors="replace")[-6000:]  # noqa: E731
    try:
        assert _wait_progress(str(tmp_path), [0, 1], [launcher]), f"{t}: workers made no progress\n{log()}"
        procs = _tree([launcher.pid])
        ports, shm_used = _listening_ports(procs), _dev_shm_users(procs)

        def of(kind):
            return [p for p in procs if p.pid != launcher.pid and any(kind in part for part in p.cmdline())]
        victims = {"scheduler": of("byteps.scheduler"), "server": of("byteps.server"), "worker": of("stress_loop")}
        assert [len(victims[r]) for r in ROLES] == [1, 2, 2], f"{t}: unexpected process tree {procs}"
        victim = victims[role][t["victim"] % len(victims[role])]
        time.sleep(t["delay"])
        victim.send_signal(signal.SIGKILL)
        try:
            code = launcher.wait(SETTLE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{t}: bpslaunch still running {SETTLE_S} s after the kill\n{log()}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    assert code == 128 + signal.SIGKILL, f"{t}: bpslaunch exited {code}\n{log()}"
    assert f"(pid {victim.pid}) exited with code 137 (SIGKILL)" in log(), log()
    procs = [p for p in procs if p.pid != launcher.pid]
    _assert_clean(t, procs, ports, shm_used, fds_before, log)
    # bpslaunch's private directory (port file) is gone too
    assert not [d for d in os.listdir("/tmp") if d.startswith(f"bps-{launcher.pid}-")]
    return t


# ------------------------------------------------------------------------------ the tests


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ROLES)
def test_kill_quick(cluster, role):
    """The default suite's random-moment trials: one per role (seed from the role, trial 1000)."""
    kill_trial(cluster, role, seed_of(role, 1000))


@pytest.mark.timeout(120)
def test_kill_under_bpslaunch_quick(tmp_path):
    launcher_trial(tmp_path, seed_of("bpslaunch", 1000))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("trial", range(SLOW_TRIALS))
@pytest.mark.parametrize("role", ROLES)
def test_kill_stress(cluster, role, trial):
    kill_trial(cluster, role, seed_of(role, trial))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("trial", range(LAUNCHER_TRIALS))
def test_kill_stress_under_bpslaunch(tmp_path, trial):
    launcher_trial(tmp_path, seed_of("bpslaunch", trial))


# ------------------------------------------------------------------------------ found by these trials


@pytest.mark.timeout(120)
def test_mixed_priorities_keep_progressing_under_credit(cluster):
    """Several tensors of different priorities in flight, partitions small enough that the credit
    (BYTEPS_SCHEDULING_CREDIT partitions' bytes) runs out: every step must complete.

    Found by the kill trials. A worker whose engine sees a lower-priority tensor first fills its
    credit with it; another worker that already has the higher-priority one queued fills its
    credit with that. Each waits at the servers for partitions the other will only send once
    credit frees: neither moves until BYTEPS_TIMEOUT ("waited ... for its turn to be sent").
    DistributedOptimizer gives every gradient its own priority, so a model with several tensors
    larger than the credit (4 x 4 MB by default) could hit this in training. Fixed in the queue
    (core/pipeline/bps_queue.h): a partition more urgent than everything in flight goes past the credit.
    """
    c = cluster(2, 2, env={"BYTEPS_PARTITION_BYTES": "4096", "BYTEPS_TIMEOUT": "8"})
    c.run_workers("stress_loop", {"seed": 1, "max_steps": 200, "priorities": True})
    codes, scodes, sched = c.wait_all(90)
    assert codes == [0, 0] and scodes == [0, 0] and sched == 0, c.all_logs()
    for r, res in c.results().items():
        assert res["value"] == {"steps": 200, "error_type": None, "error": None}, (r, res["value"])


CROSSED_ENV = {"BYTEPS_PARTITION_BYTES": "100000", "BYTEPS_SCHEDULING_CREDIT": "1", "BYTEPS_TIMEOUT": "15"}


#: plain ops, and ops the native core encodes (fp16) on their way through the same send queue
CODECS = {"plain": {}, "fp16": {"BYTEPS_COMPRESSOR": "fp16"}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("local_size", [1, 2], ids=["2x1", "2x2"])
def test_tensors_queued_in_different_orders_keep_progressing(cluster, codec, local_size):
    """Two machines queue the same two tensors, of one priority, in opposite orders, one partition on
    the wire at a time: every step completes, without waiting for a stalled credit.

    Found by CI (tests/test_native_core.py's local reduce test on 2x2, under load): ties among
    equal priorities went by arrival, so machine 0 filled its credit with x, machine 1 with y, and each
    server waited for the other machine's push until BYTEPS_TIMEOUT. On 2x2 the owners' pushes of the
    machines' sums are what cross, as when two machines' local sums finish in different orders. Ties
    now go by wire key, one order on every worker (core/pipeline/bps_queue.h). The sums are small integers,
    exact in fp16 too.
    """
    c = cluster(2, 1, local_size=local_size, env={**CROSSED_ENV, **CODECS[codec]})
    c.run_workers("crossed_orders")
    codes, scodes, sched = c.wait_all(90)
    assert codes == [0] * (2 * local_size) and scodes == [0] and sched == 0, c.all_logs()
    for r, res in c.results().items():
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["value"] == {"steps": 5, "credit_stalls": 0}, (r, res["value"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", list(CODECS))
def test_workers_that_disagree_on_priorities_keep_progressing(cluster, codec):
    """Each worker gives its first tensor the higher priority, so the workers disagree on which of x and
    y is urgent and each fills its one-partition credit with a different tensor. Only the stall rule
    can resolve that: after a second without a reply, the head goes past the credit. Every step
    completes with exact sums, and the stall rule is what did it (credit_stalls > 0)."""
    c = cluster(2, 1, env={**CROSSED_ENV, **CODECS[codec]})
    c.run_workers("crossed_orders", {"crossed_priorities": True, "steps": 2})
    codes, scodes, sched = c.wait_all(90)
    assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()
    for r, res in c.results().items():
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["value"]["steps"] == 2 and res["value"]["credit_stalls"] >= 1, (r, res["value"])
