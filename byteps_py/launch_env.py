"""Other launchers' environments: torchrun, mpirun and horovodrun (Gloo) become a byteps job.

:func:`translate`, called at the top of :func:`byteps.config.load`, derives DMLC_NUM_WORKER,
DMLC_WORKER_ID, BYTEPS_LOCAL_RANK/SIZE and the scheduler's address from the launcher's variables when
no byteps job is described, and global rank 0 starts the scheduler and servers itself
(:func:`start_services`). The mapping, overrides and life cycle: docs/launchers.md.
"""
import atexit
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .errors import ConfigError

#: variables describing a byteps job; when any is set the launcher variables are ignored
_JOB_VARIABLES = ("DMLC_NUM_WORKER", "DMLC_WORKER_ID")

DEFAULT_PORT = 29500  #: base port when a launcher names none (mpirun); the scheduler uses base + 1
SCHEDULER_START_TIMEOUT = 30.0  #: seconds rank 0 waits for the scheduler it started to listen

_services = []           # Popen objects of the scheduler and servers this process started
_services_lock = threading.Lock()
_services_started = False


def _get(env, name):
    value = env.get(name)
    return None if value is None or not value.strip() else value.strip()


def _int(env, name, minimum=0, default=None):
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer (set by the launcher; see docs/launchers.md)") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum} (see docs/launchers.md)")
    return value


def detect(env):
    """The launcher that started this process, as a dict, or None.

    Keys: launcher, rank, size, local_rank, local_size, node_rank, num_nodes, host (scheduler host or
    None), port (base port or None), job (an id shared by the job's processes or None).
    """
    if _get(env, "RANK") is not None and _get(env, "WORLD_SIZE") is not None and \
            _get(env, "LOCAL_RANK") is not None:
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE", 1)
        local_size = _int(env, "LOCAL_WORLD_SIZE", 1, size)  # unset in a hand-made env:// setup: one node
        return dict(launcher="torchrun", rank=rank, size=size, local_rank=_int(env, "LOCAL_RANK"),
                    local_size=local_size, node_rank=_int(env, "GROUP_RANK", 0, rank // local_size),
                    num_nodes=_int(env, "GROUP_WORLD_SIZE", 1), host=_get(env, "MASTER_ADDR"),
                    port=_int(env, "MASTER_PORT", 1), job=_get(env, "TORCHELASTIC_RUN_ID"))
    if _get(env, "HOROVOD_RANK") is not None and _get(env, "HOROVOD_SIZE") is not None:
        rank, size = _int(env, "HOROVOD_RANK"), _int(env, "HOROVOD_SIZE", 1)
        local_size = _int(env, "HOROVOD_LOCAL_SIZE", 1, size)
        rdv_addr, rdv_port = _get(env, "HOROVOD_GLOO_RENDEZVOUS_ADDR"), _int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", 1)
        return dict(launcher="horovodrun", rank=rank, size=size, local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0, rank),
                    local_size=local_size, node_rank=_int(env, "HOROVOD_CROSS_RANK", 0, rank // local_size),
                    num_nodes=_int(env, "HOROVOD_CROSS_SIZE", 1), host=None, port=rdv_port,
                    job=f"{rdv_addr}:{rdv_port}" if rdv_addr else None)
    for prefix, launcher in (("OMPI_COMM_WORLD_", "mpirun"), ("PMI_", "mpirun")):
        if _get(env, prefix + "RANK") is not None and _get(env, prefix + "SIZE") is not None:
            rank, size = _int(env, prefix + "RANK"), _int(env, prefix + "SIZE", 1)
            if prefix == "OMPI_COMM_WORLD_":
                local_rank, local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), \
                    _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
                job = _get(env, "OMPI_MCA_ess_base_jobid") or _get(env, "PMIX_NAMESPACE")
            else:  # MPICH / Intel MPI (hydra)
                local_rank, local_size = _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS", 1)
                job = _get(env, "PMIX_NAMESPACE") or _get(env, "PMI_KVSNAME")
            if local_rank is None or local_size is None:
                local_rank, local_size = rank, size  # no node information: one node
            return dict(launcher=launcher, rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                        node_rank=rank // local_size, num_nodes=None, host=None, port=None, job=job)
    return None


def _job_port(job):
    """A base port for launchers that name none, derived from the job id so that concurrent jobs differ."""
    if not job:
        return DEFAULT_PORT
    return 20000 + int(hashlib.sha1(job.encode()).hexdigest(), 16) % 20000


def translate(env, role=None):
    """``env`` plus the DMLC_*/BYTEPS_* variables derived from another launcher's, or ``env`` itself.

    Returns ``env`` unchanged when no launcher is detected, when the job is already described by
    DMLC_NUM_WORKER / DMLC_WORKER_ID, for the scheduler and server roles, and for a one-process job
    (which runs standalone). When ``env`` is this process's own ``os.environ`` and this is global
    rank 0, the scheduler and servers are started here (once per process).
    """
    role = (role or _get(env, "DMLC_ROLE") or "worker").lower()
    if role != "worker" or any(_get(env, k) is not None for k in _JOB_VARIABLES):
        return env
    info = detect(env)
    if info is None or info["size"] <= 1:
        return env
    out = dict(env, **derive(env, info))
    if env is os.environ and info["rank"] == 0:
        start_services(out)
    return out


def derive(env, info):
    """The DMLC_*/BYTEPS_* variables for a job described by ``info`` (see :func:`detect`)."""
    who = info["launcher"]
    size, local_size = info["size"], info["local_size"]
    if not 0 <= info["rank"] < size:
        raise ConfigError(f"{who}: rank {info['rank']} is outside 0..{size - 1}")
    if local_size < 1 or size % local_size:
        raise ConfigError(f"{who}: world size {size} is not a multiple of the local size {local_size}; byteps "
                          "needs the same number of processes on every node (set DMLC_* yourself otherwise)")
    num_nodes = size // local_size
    if info["num_nodes"] is not None and info["num_nodes"] != num_nodes:
        raise ConfigError(f"{who}: {info['num_nodes']} nodes but world size {size} / local size {local_size} = "
                          f"{num_nodes}; byteps needs the same number of processes on every node")
    if not 0 <= info["local_rank"] < local_size or not 0 <= info["node_rank"] < num_nodes:
        raise ConfigError(f"{who}: local rank {info['local_rank']} of {local_size} on node {info['node_rank']} "
                          f"of {num_nodes} is inconsistent")
    host, port, explicit_port = info["host"], info["port"], False
    override = _get(env, "BYTEPS_SCHEDULER_URI")
    if override is not None:
        h, sep, p = override.rpartition(":")
        host, port, explicit_port = (h, int(p), True) if sep and p.isdigit() else (override, port, False)
    host = _get(env, "DMLC_PS_ROOT_URI") or host or _get(env, "MASTER_ADDR")
    if host is None:
        if num_nodes > 1:
            raise ConfigError(f"{who}: a job on {num_nodes} nodes needs the address of global rank 0's host, "
                              "where byteps starts its scheduler: set BYTEPS_SCHEDULER_URI=host[:port] "
                              "(or MASTER_ADDR) for every process. See docs/launchers.md.")
        host = "127.0.0.1"
    if _get(env, "DMLC_PS_ROOT_PORT") is not None:
        sched_port = _int(env, "DMLC_PS_ROOT_PORT", 1)
    elif explicit_port:
        sched_port = port
    else:  # the launcher's port (ports are >= 1), else MASTER_PORT, else one derived from the job id
        sched_port = (port or _int(env, "MASTER_PORT", 1) or _job_port(info["job"])) + 1
    if not 0 < sched_port < 65536:
        raise ConfigError(f"{who}: scheduler port {sched_port} is outside 1..65535; set DMLC_PS_ROOT_PORT")
    out = {
        "DMLC_ROLE": "worker",
        "DMLC_NUM_WORKER": str(num_nodes),
        "DMLC_WORKER_ID": str(info["node_rank"]),
        "DMLC_NUM_SERVER": _get(env, "DMLC_NUM_SERVER") or "1",
        "DMLC_PS_ROOT_URI": host,
        "DMLC_PS_ROOT_PORT": str(sched_port),
        "BYTEPS_LOCAL_RANK": str(info["local_rank"]),
        "BYTEPS_LOCAL_SIZE": str(local_size),
        "BYTEPS_LAUNCHER": who,
    }
    if _get(env, "BYTEPS_JOB_ID") is None and info["job"]:
        out["BYTEPS_JOB_ID"] = f"{who}-{info['job']}"
    return out


# ----------------------------------------------------------------------------- services of rank 0


def start_services(job_env):
    """Start the scheduler and DMLC_NUM_SERVER servers as children of this process (once)."""
    global _services_started
    with _services_lock:
        if _services_started:
            return
        _services_started = True
        from . import port_file
        from .procctl import make_preexec as _make_preexec  # PR_SET_PDEATHSIG: they die with this process

        base = dict(job_env)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            base.pop(name, None)  # the services are no launcher's ranks
        tmpdir = tempfile.mkdtemp(prefix="byteps-services-")
        path = os.path.join(tmpdir, "port")
        scheduler = subprocess.Popen([sys.executable, "-m", "byteps.scheduler"], preexec_fn=_make_preexec(),
                                     stdin=subprocess.DEVNULL,
                                     env=dict(base, DMLC_ROLE="scheduler", BYTEPS_SCHEDULER_PORT_FILE=path))
        _services.append(scheduler)
        atexit.register(_stop_services)
        # Fail fast (rather than after BYTEPS_TIMEOUT) when the scheduler cannot start, e.g. its port is taken.
        try:
            if port_file.wait(path, lambda: scheduler.poll() is not None, SCHEDULER_START_TIMEOUT) is None:
                raise ConfigError(
                    f"the byteps scheduler that rank 0 started ({job_env['BYTEPS_LAUNCHER']} job) exited with code "
                    f"{scheduler.returncode} before it was listening on {job_env['DMLC_PS_ROOT_URI']}:"
                    f"{job_env['DMLC_PS_ROOT_PORT']} (port in use? set DMLC_PS_ROOT_PORT or "
                    "BYTEPS_SCHEDULER_URI; its message is above). See docs/launchers.md.")
        except TimeoutError:
            raise ConfigError("the byteps scheduler rank 0 started did not listen within "
                              f"{SCHEDULER_START_TIMEOUT:g} s") from None
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
        for _ in range(int(job_env["DMLC_NUM_SERVER"])):
            server = subprocess.Popen([sys.executable, "-m", "byteps.server"], env=dict(base, DMLC_ROLE="server"),
                                      preexec_fn=_make_preexec(), stdin=subprocess.DEVNULL)
            _services.append(server)


def service_pids():
    """Process ids of the scheduler and servers this process started (empty unless it is rank 0)."""
    return [p.pid for p in _services]


def _stop_services():
    """At exit (after byteps' own exit notice): give the services time to end the job, then kill them."""
    try:
        limit = float(os.environ.get("BYTEPS_SERVICES_EXIT_TIMEOUT", "30"))
    except ValueError:
        limit = 30.0
    deadline = time.monotonic() + limit
    for p in _services:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in _services:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in _services:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
