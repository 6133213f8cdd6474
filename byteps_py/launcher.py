"""bpslaunch: start the processes of a byteps job and take them all down together.

Its modes (local, role, slurm, k8s, join; launch_args.py's help text and docs/launchers.md) each
validate the environment first (a ConfigError is exit status 2) and return a function that starts
the children in one :class:`~byteps.launch_job.Job`, whose teardown ends every child and its
descendants on every way out. Exit status: 0 when every process succeeded; the first failing
child's code (128+N for a child killed by signal N); 124 for ``--timeout``; 128+N when bpslaunch
itself got signal N; 2 for a usage or environment error; 127/126 when CMD cannot be found/executed.
"""
# Licensed under the Apache License, Version 2.0.
import os
import secrets
import subprocess
import sys

from . import config, log
from .errors import ConfigError
from .launch_args import parse
from .launch_job import Job, JobStopped, say

#: Command lines of the two service roles (module constants so tests can substitute stubs).
SCHEDULER_ARGV = [sys.executable, "-m", "byteps.scheduler"]
SERVER_ARGV = [sys.executable, "-m", "byteps.server"]


def _visible_device_count(env):
    """Number of GPUs listed in NVIDIA_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, or None."""
    for name in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        raw = env.get(name, "").strip()
        if not raw or raw.lower() in ("all", "none", "void"):
            continue
        ids = [d.strip() for d in raw.split(",") if d.strip()]
        if ids and not any(d.startswith("-") for d in ids):
            return len(ids)
    return None


def _worker_defaults(env, procs):
    """Defaults for the worker processes, each only where the user set nothing (docs/env.md): OMP_NUM_THREADS
    = CPUs / worker processes on this machine, as torchrun does, and CUDA_DEVICE_ORDER=PCI_BUS_ID, the
    order in which topology/detect.py maps GPUs to PCIe switches."""
    if not env.get("OMP_NUM_THREADS", "").strip():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // procs))
    if not env.get("CUDA_DEVICE_ORDER", "").strip():
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"


def _plan_local(opts, command):
    if not command:
        raise ConfigError("--local needs a command to run on the workers (bpslaunch --local ... -- CMD)")
    # a Summation Service on every worker machine by default (the design's k = 0)
    nw, nl = opts.workers, opts.local_size or 1
    ns = opts.servers or nw
    job_id = f"bps-{os.getpid()}-{secrets.token_hex(4)}"
    base = dict(os.environ)
    # Variables that are per-process here must not leak from our own environment.
    for name in ("DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "BYTEPS_SCHEDULER_PORT_FILE",
                 "DMLC_INTERFACE"):
        base.pop(name, None)
    base.update(DMLC_NUM_WORKER=str(nw), DMLC_NUM_SERVER=str(ns), DMLC_PS_ROOT_URI="127.0.0.1",
                DMLC_NODE_HOST="127.0.0.1", BYTEPS_JOB_ID=job_id, PYTHONUNBUFFERED="1")
    # every connection of the job proves it knows this secret (core/auth.py); never printed
    base.setdefault("BYTEPS_JOB_SECRET", secrets.token_hex(32))
    _worker_defaults(base, nw * nl)

    def worker_env(i, j, port):
        return dict(base, DMLC_ROLE="worker", DMLC_PS_ROOT_PORT=str(port), DMLC_WORKER_ID=str(i),
                    BYTEPS_LOCAL_RANK=str(j), BYTEPS_LOCAL_SIZE=str(nl))

    # Validate the rest of the environment (BYTEPS_LOG_LEVEL, BYTEPS_TIMEOUT, ...) as a
    # worker will see it, with a placeholder port: fail now, not in W*L copies later.
    config.load(worker_env(0, 0, 1))

    def run(job):
        tmpdir = job.make_tmpdir(f"{job_id}-")
        port_file = os.path.join(tmpdir, "port")
        scheduler = job.spawn("scheduler", SCHEDULER_ARGV,
                              dict(base, DMLC_ROLE="scheduler", DMLC_PS_ROOT_PORT="0",
                                   BYTEPS_SCHEDULER_PORT_FILE=port_file),
                              essential=False, stdin=subprocess.DEVNULL)
        port = job.wait_for_port(scheduler, port_file)
        log.logger.info("job %s: scheduler on 127.0.0.1:%d", job_id, port)
        for s in range(ns):
            job.spawn(f"server {s}", SERVER_ARGV,
                      dict(base, DMLC_ROLE="server", DMLC_PS_ROOT_PORT=str(port)),
                      essential=False, stdin=subprocess.DEVNULL, may_fail=config._bool(base, "BYTEPS_ELASTIC"))
        for i in range(nw):
            for j in range(nl):
                job.spawn(f"worker {i}.{j}", command, worker_env(i, j, port))
        return job.wait()

    return run


def _single_machine(env):
    """DMLC_NUM_WORKER=1 with several local processes and no scheduler address: BytePS runs such a
    job without scheduler or server (BYTEPS_FORCE_DISTRIBUTED=1 and DMLC_PS_ROOT_URI opt out)."""
    return (env.get("DMLC_NUM_WORKER", "").strip() == "1" and not env.get("DMLC_PS_ROOT_URI", "").strip()
            and int(env.get("BYTEPS_LOCAL_SIZE", "").strip() or 1) > 1
            and env.get("BYTEPS_FORCE_DISTRIBUTED", "").strip() not in ("1", "true", "yes"))


def _plan_role(opts, command):
    env = dict(os.environ)
    role = (env.get("DMLC_ROLE") or "worker").strip().lower()
    if role == "worker":
        if opts.local_size is not None:
            env["BYTEPS_LOCAL_SIZE"] = str(opts.local_size)
        elif not env.get("BYTEPS_LOCAL_SIZE", "").strip():
            gpus = _visible_device_count(env)
            if gpus:
                env["BYTEPS_LOCAL_SIZE"] = str(gpus)
        env["BYTEPS_LOCAL_RANK"] = "0"  # as local rank 0 will see it
        if _single_machine(env):
            # BytePS's single-machine mode: nobody starts a scheduler or server for one worker
            # machine, so run its processes as a --local job with its own (exact, as always)
            opts.workers, opts.servers = 1, int(env.get("DMLC_NUM_SERVER", "").strip() or 1)
            opts.local_size = int(env["BYTEPS_LOCAL_SIZE"])
            return _plan_local(opts, command)
    cfg = config.load(env)  # raises ConfigError naming the bad variable
    env["PYTHONUNBUFFERED"] = "1"

    if cfg.role in ("scheduler", "server"):
        if command:
            say(f"warning: DMLC_ROLE={cfg.role} ignores the command {' '.join(command)!r}")
        argv = SCHEDULER_ARGV if cfg.role == "scheduler" else SERVER_ARGV
        env = dict(os.environ, PYTHONUNBUFFERED="1")

        def run_service(job):
            job.spawn(cfg.role, argv, env, stdin=subprocess.DEVNULL)
            return job.wait()

        return run_service

    if not command:
        raise ConfigError("DMLC_ROLE=worker needs a command to run (bpslaunch [options] CMD ...)")

    _worker_defaults(env, cfg.local_size)

    def run_workers(job):
        for j in range(cfg.local_size):
            job.spawn(f"worker {cfg.worker_id}.{j}", command,
                      dict(env, BYTEPS_LOCAL_RANK=str(j), BYTEPS_LOCAL_SIZE=str(cfg.local_size)))
        return job.wait()

    return run_workers


def _plan_join(opts, command):
    """bpslaunch --join HOST:PORT: an elastic server for the running job at that scheduler (docs/elastic.md)."""
    host, _, port = opts.join.rpartition(":")
    env = dict(os.environ, DMLC_ROLE="server", DMLC_PS_ROOT_URI=host.strip("[]"), DMLC_PS_ROOT_PORT=port,
               BYTEPS_ELASTIC="1", PYTHONUNBUFFERED="1")
    config.load(env)  # raises ConfigError naming the bad variable
    if command:
        say(f"warning: --join runs a server; it ignores the command {' '.join(command)!r}")
    if not env.get("BYTEPS_JOB_SECRET", "").strip():
        say("warning: BYTEPS_JOB_SECRET is not set: a job that authenticates its nodes (bpslaunch sets a secret) "
            "will refuse this server")

    def run_server(job):
        job.spawn("server", SERVER_ARGV, env, stdin=subprocess.DEVNULL)
        return job.wait()

    return run_server


def _plan_slurm(opts, command):
    """bpslaunch --slurm: this task's scheduler/server/workers, from SLURM_* (byteps/cluster_env.py)."""
    from . import cluster_env

    task = cluster_env.slurm_task(os.environ, server_nodes=opts.server_nodes, local_size=opts.local_size)
    base = dict(os.environ, PYTHONUNBUFFERED="1", **task.env)
    for name in ("DMLC_ROLE", "BYTEPS_LOCAL_RANK", "BYTEPS_SCHEDULER_PORT_FILE", "BYTEPS_SERVER_ROLE"):
        base.pop(name, None)
    if task.local_ranks and not command:
        raise ConfigError("bpslaunch --slurm needs a command for the workers (bpslaunch --slurm -- CMD)")

    def worker_env(j):
        return dict(base, DMLC_ROLE="worker", BYTEPS_LOCAL_RANK=str(j))

    if task.local_ranks:
        config.load(worker_env(task.local_ranks[0]))  # fail here, once, naming the bad variable
        _worker_defaults(base, int(task.env["BYTEPS_LOCAL_SIZE"]))
    else:
        config.load(dict(base, DMLC_ROLE="server"))
    host = task.hosts[task.node]
    parts = (["scheduler"] if task.scheduler else []) + ([f"{task.server} server"] if task.server else []) + \
        ([f"worker {task.worker_id}, local ranks {list(task.local_ranks)}"] if task.local_ranks else [])
    say(f"slurm: node {task.node} ({host}) of {list(task.hosts)}: "
         + (", ".join(parts) or "nothing to run (a spare task on a server node)"))

    def run(job):
        if task.scheduler:
            job.spawn("scheduler", SCHEDULER_ARGV, dict(base, DMLC_ROLE="scheduler"), essential=False,
                      stdin=subprocess.DEVNULL)
        if task.server:
            # a server-only task ends when its server does (the scheduler ends the job)
            job.spawn(f"server {task.node}", SERVER_ARGV,
                      dict(base, DMLC_ROLE="server", BYTEPS_SERVER_ROLE=task.server),
                      essential=not task.local_ranks, stdin=subprocess.DEVNULL,
                      may_fail=bool(task.local_ranks) and config._bool(base, "BYTEPS_ELASTIC"))
        for j in task.local_ranks:
            job.spawn(f"worker {task.worker_id}.{j}", command, worker_env(j))
        return job.wait()

    return run


def _plan_k8s(opts, command):
    """bpslaunch --k8s: the pod's DMLC_* from its name/index and IP, then role mode."""
    from . import cluster_env

    os.environ.update(cluster_env.k8s_env(os.environ))
    return _plan_role(opts, command)


# ---------------------------------------------------------------------------------------
# Command line


def _plan_text(opts):
    """bpslaunch --plan: the k/n placement of byteps.placement.plan for the given job shape, and the
    partition size and credit byteps/autotune.py chooses for it."""
    from . import autotune, placement

    n = opts.worker_machines or int(os.environ.get("DMLC_NUM_WORKER", "0") or 0)
    if n < 1 or opts.extra < 0:
        raise ValueError("--plan needs --worker-machines N >= 1 (or DMLC_NUM_WORKER) and --extra K >= 0")
    plan = placement.plan(n, opts.extra, placement.parse_bytes(opts.model_bytes), placement.parse_rate(opts.bandwidth))
    return plan.table() + "\n" + autotune.plan_text(plan, autotune.parse_duration(opts.latency))


def _print_report(make, errors):
    """--plan, --stages, --topology: print ``make()``, or name its error and return exit status 2."""
    try:
        print(make())
    except errors as e:
        say(f"error: {e}")
        return 2
    return 0


def main(argv=None):
    """Entry point of ``bpslaunch`` / ``python -m byteps.launcher``; returns the exit status.

    It owns its process: children, adopted orphans and signal handlers are managed as if
    bpslaunch were the only thing running in it.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        opts, command = parse(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    if opts.plan:
        return _print_report(lambda: _plan_text(opts), ValueError)
    if opts.topology is not None:  # the §4.2.3 plan for this machine or a description (docs/topology.md)
        from .topology import TopologyError, plan_text

        return _print_report(lambda: plan_text(opts.topology or None, local_size=opts.local_size), TopologyError)
    if opts.stages:  # the stage lists core/stages.py builds, as the engine would for this environment
        from byteps.core import stages

        return _print_report(lambda: stages.situations_text(opts.local_size or 2), ConfigError)
    if opts.timeline:  # every child inherits it; the scheduler (ours or a role-mode one) writes the file
        os.environ["BYTEPS_TIMELINE"] = os.path.abspath(opts.timeline)
    try:
        plan = (_plan_local if opts.local else _plan_slurm if opts.slurm else _plan_k8s if opts.k8s
                else _plan_join if opts.join is not None else _plan_role)
        run = plan(opts, command)
    except ConfigError as e:
        say(f"error: {e}")
        return 2
    log.setup("launcher")
    with Job(prefix=opts.prefix, timeout=opts.timeout, grace=opts.grace) as job:
        try:
            return run(job)
        except JobStopped as stop:
            say(stop.reason)
            return stop.code


if __name__ == "__main__":
    sys.exit(main())
