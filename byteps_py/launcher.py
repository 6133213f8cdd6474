"""bpslaunch: start the processes of a byteps job and take them all down together.

Modes:

* **Local mode** (``bpslaunch --local --workers W --servers S [--local-size L] -- CMD ...``)
  runs a whole job on this machine: one scheduler (``python -m byteps.scheduler``), S
  Summation Service servers (``python -m byteps.server``; default W, one per worker machine as
  in the BytePS design) and W worker "machines" of L processes each running CMD. The
  scheduler binds a free port and reports it through a file in a private temporary
  directory, so no fixed port is ever used.

* **Role mode** (no ``--local``; BytePS-compatible): the role comes from ``DMLC_ROLE``.
  ``scheduler`` and ``server`` run the matching byteps module; ``worker`` runs
  ``BYTEPS_LOCAL_SIZE`` local copies of CMD with ``BYTEPS_LOCAL_RANK`` set. The environment
  is validated by :func:`byteps.config.load` first, so a missing or malformed variable is
  an error (exit status 2), not a silent ``exit 0`` as in the original launcher.

* **Cluster managers**: ``bpslaunch --slurm [--server-nodes K] -- CMD`` under ``srun`` and
  ``bpslaunch --k8s -- CMD`` in a Kubernetes pod derive the roles and DMLC_* variables from the
  manager's environment (byteps/cluster_env.py; docs/slurm.md, docs/kubernetes.md).

In every mode every child belongs to one :class:`Job`, and every way out (normal end, a
failing child, a signal, ``--timeout``) goes through :meth:`Job.teardown`, which ends the
children *and their descendants*, drains their output and removes the temporary directory.
Exit status: 0 when every process succeeded; the first failing child's code (128+N for a
child killed by signal N, as a shell reports it); 124 for ``--timeout``; 128+N when
bpslaunch itself got signal N (130 for SIGINT, 143 for SIGTERM); 2 for a usage or
environment error; 127/126 when CMD cannot be found/executed.
"""
# Licensed under the Apache License, Version 2.0.
import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from . import config, log
from .errors import ConfigError
from .procctl import become_subreaper as _become_subreaper, make_preexec as _make_preexec

#: Command lines of the two service roles (module constants so tests can substitute stubs).
SCHEDULER_ARGV = [sys.executable, "-m", "byteps.scheduler"]
SERVER_ARGV = [sys.executable, "-m", "byteps.server"]

POLL_INTERVAL = 0.05  #: seconds between polls of the children
SCHEDULER_START_TIMEOUT = 30.0  #: seconds the scheduler may take to write its port file
TERM_TIMEOUT = 5.0  #: seconds between SIGTERM and SIGKILL at teardown
DRAIN_TIMEOUT = 5.0  #: seconds to wait for the output reader threads after the children are gone

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_EPILOG = """\
modes:
  local    Run a complete job on this machine: 1 scheduler, S servers (default W: a
           Summation Service per worker machine) and W worker machines of L processes
           each running CMD (W*L processes of CMD in all).
           Every child gets DMLC_* and BYTEPS_* variables, including DMLC_WORKER_ID,
           BYTEPS_LOCAL_RANK and BYTEPS_LOCAL_SIZE for the workers.
             bpslaunch --local --workers 2 --servers 1 --local-size 2 -- python train.py --lr 0.1

  role     BytePS-compatible: one bpslaunch per role per machine, configured by the
           environment (see docs/env.md). DMLC_ROLE=scheduler or server runs that service
           (CMD is ignored); DMLC_ROLE=worker runs BYTEPS_LOCAL_SIZE local processes of CMD
           (default: the number of NVIDIA_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES, else 1).
             DMLC_ROLE=worker DMLC_WORKER_ID=0 DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 \\
             DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=9000 bpslaunch python train.py

  slurm    Under srun (one task per node, or one per worker process): roles, ranks and the
           scheduler address come from SLURM_*; the last K nodes run only a server.
             srun --ntasks-per-node=1 bpslaunch --slurm --server-nodes 1 -- python train.py

  k8s      In a pod of examples/kubernetes/: DMLC_WORKER_ID from the pod's index, DMLC_NODE_HOST
           from POD_IP, the rest from the manifest; then as role mode.

CMD runs directly as an argument list, without a shell; write `--` before it to end
bpslaunch's own options (`bpslaunch --local --workers 2 -- python train.py`). A single quoted
CMD with spaces or shell syntax (`bpslaunch "python3 train.py --lr 0.1"`, as BytePS's docs
write it) runs through /bin/sh -c, as BytePS's launcher does. Each output line is prefixed
with its process, e.g. "[worker 0.1] ", "[server 0] ", "[scheduler] ", unless --no-prefix.

exit status: 0 on success; the first failing process's code (128+N if killed by signal N);
124 on --timeout; 130/143 on SIGINT/SIGTERM; 2 on a usage or environment error.
"""


def _say(message):
    """Print one of the launcher's own lines on stderr (under the output lock, so it never
    lands inside a child's line)."""
    with _OUTPUT_LOCK:
        sys.stderr.write(f"bpslaunch: {message}\n")
        sys.stderr.flush()


# One lock for both streams: a child's stdout and stderr lines, and our own, stay whole.
_OUTPUT_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------
# Children and the job that owns them


def _exit_code(returncode):
    """Popen's returncode as a shell reports it: -N (killed by signal N) becomes 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(code):
    if code > 128:
        try:
            return f"{code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return str(code)


def _write(stream, data):
    buf = getattr(stream, "buffer", None)
    if buf is not None:
        buf.write(data)
        buf.flush()
    else:  # a text-only stream (e.g. replaced by a test harness)
        stream.write(data.decode(errors="replace"))
        stream.flush()


def _pump(src, dest_name, prefix):
    """Copy lines from a child's pipe to our stdout/stderr, each prefixed with its tag."""
    with src:
        for line in iter(src.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            try:
                with _OUTPUT_LOCK:
                    _write(getattr(sys, dest_name), prefix + line)
            except (OSError, ValueError):
                pass  # our own output is gone (closed pipe); keep draining so the child never blocks


class Child:
    """One process started by the job."""

    def __init__(self, tag, popen, essential, may_fail=False):
        self.tag = tag  #: e.g. "worker 0.1"
        self.popen = popen
        self.essential = essential  #: the job is done when every essential child exited 0
        #: its failure does not stop the job: a server of a BYTEPS_ELASTIC=1 job (the scheduler removes it)
        self.may_fail = may_fail
        self.warned = False
        self.readers = []

    @property
    def pid(self):
        return self.popen.pid

    @property
    def code(self):
        rc = self.popen.poll()
        return None if rc is None else _exit_code(rc)


class JobStopped(Exception):
    """Raised inside a running job to stop it; `code` is bpslaunch's exit status."""

    def __init__(self, code, reason):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Job:
    """Owns the children of one bpslaunch run; leaving the ``with`` block tears them down.

    Use from the main thread: it installs handlers for SIGINT/SIGTERM/SIGHUP that only
    record the signal, and the wait loops turn that into :class:`JobStopped`.
    """

    def __init__(self, prefix=True, timeout=None, grace=30.0):
        self.prefix = prefix
        self.timeout = timeout
        self.grace = grace
        self.children = []
        self.tmpdir = None
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._signal = None
        self._signal_count = 0
        self._old_handlers = {}
        self._preexisting = set()
        self._preexec = _make_preexec()
        self._torn_down = False

    # -- lifetime ---------------------------------------------------------------------
    def __enter__(self):
        try:
            self._preexisting = {p.pid for p in psutil.Process().children()}
        except psutil.Error:
            self._preexisting = set()
        _become_subreaper()
        if threading.current_thread() is threading.main_thread():
            for sig in _FORWARDED_SIGNALS:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc):
        try:
            self.teardown()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
        return False

    def _on_signal(self, signum, frame):
        # Only record it: the wait loops (and teardown) act on it at a safe point.
        self._signal_count += 1
        if self._signal is None:
            self._signal = signum

    def check(self):
        """Raise JobStopped if a signal arrived or the --timeout expired."""
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            raise JobStopped(128 + self._signal, f"received {name}; stopping the job")
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise JobStopped(124, f"--timeout {self.timeout:g}s expired; stopping the job")

    # -- starting ---------------------------------------------------------------------
    def make_tmpdir(self, prefix):
        self.tmpdir = tempfile.mkdtemp(prefix=prefix)  # mode 0700: private to this user
        return self.tmpdir

    def spawn(self, tag, argv, env, essential=True, stdin=None, may_fail=False):
        """Start one child; its output is prefixed with ``[tag]`` unless --no-prefix."""
        pipe = subprocess.PIPE if self.prefix else None
        try:
            popen = subprocess.Popen(argv, env=env, stdin=stdin, stdout=pipe, stderr=pipe,
                                     start_new_session=False, preexec_fn=self._preexec)
        except FileNotFoundError as e:
            raise JobStopped(127, f"{tag}: cannot run {argv[0]!r}: {e.strerror}") from None
        except PermissionError as e:
            raise JobStopped(126, f"{tag}: cannot run {argv[0]!r}: {e.strerror}") from None
        child = Child(tag, popen, essential, may_fail)
        self.children.append(child)
        if self.prefix:
            head = f"[{tag}] ".encode()
            for src, dest in ((popen.stdout, "stdout"), (popen.stderr, "stderr")):
                t = threading.Thread(target=_pump, args=(src, dest, head), daemon=True,
                                     name=f"bpslaunch {tag} {dest}")
                t.start()
                child.readers.append(t)
        log.logger.info("started %s (pid %d): %s", tag, popen.pid, " ".join(argv))
        return child

    # -- waiting ----------------------------------------------------------------------
    def _check_failures(self):
        for c in self.children:
            code = c.code
            if code and c.may_fail:
                if not c.warned:
                    c.warned = True
                    _say(f"warning: {c.tag} (pid {c.pid}) exited with code {_describe(code)}; the job goes on "
                         "without it (BYTEPS_ELASTIC=1: the scheduler removes a lost server)")
                continue
            if code:
                raise JobStopped(code, f"{c.tag} (pid {c.pid}) exited with code {_describe(code)}; "
                                       "stopping the job")

    def _reap_orphans(self):
        """Collect adopted orphans that exited, so they do not linger as zombies."""
        ours = {c.pid for c in self.children} | self._preexisting
        try:
            kids = psutil.Process().children()
        except psutil.Error:
            return
        for p in kids:
            if p.pid not in ours:
                try:
                    os.waitpid(p.pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def wait_for_port(self, child, path, limit=SCHEDULER_START_TIMEOUT):
        """Wait until `child` (the scheduler) writes its port number into `path`."""
        deadline = time.monotonic() + limit
        while True:
            self.check()
            port = _read_port(path)
            if port is not None:
                return port
            code = child.code
            if code is not None:
                self._drain(child, 1.0)  # its error output first, then our verdict
                raise JobStopped(code or 1, f"{child.tag} (pid {child.pid}) exited with code "
                                            f"{_describe(code)} before writing its port to {path}; "
                                            "see its output above")
            if time.monotonic() >= deadline:
                raise JobStopped(1, f"{child.tag} (pid {child.pid}) did not write its port to {path} "
                                    f"within {limit:g}s")
            time.sleep(POLL_INTERVAL / 2)

    def wait(self):
        """Run until the job ends; return 0 or raise JobStopped.

        The job ends well when every essential child (the workers) exited 0; the services
        then get `grace` seconds to exit on their own, as they do when a job completes.
        """
        ticks = 0
        while True:
            self.check()
            self._check_failures()
            if all(c.code == 0 for c in self.children if c.essential):
                break
            ticks += 1
            if ticks % 20 == 0:
                self._reap_orphans()
            time.sleep(POLL_INTERVAL)
        deadline = time.monotonic() + self.grace
        while any(c.code is None for c in self.children):
            self.check()
            self._check_failures()
            if time.monotonic() >= deadline:
                late = ", ".join(f"{c.tag} (pid {c.pid})" for c in self.children if c.code is None)
                _say(f"warning: {late} still running {self.grace:g}s after the workers finished; "
                     "terminating")
                break
            time.sleep(POLL_INTERVAL)
        return 0

    # -- teardown ---------------------------------------------------------------------
    def _descendants(self):
        """Every live process below us that this job started, at any depth (children we
        adopted as subreaper included; children the host process had before are not)."""
        try:
            kids = psutil.Process().children()
        except psutil.Error:
            return []
        procs = []
        for k in kids:
            if k.pid in self._preexisting:
                continue
            procs.append(k)
            try:
                procs += k.children(recursive=True)
            except psutil.Error:
                pass
        return procs

    def _gone(self, proc):
        for c in self.children:
            if c.pid == proc.pid:
                return c.popen.poll() is not None  # reaps it, keeping its exit status
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False
        try:
            os.waitpid(proc.pid, os.WNOHANG)  # an adopted orphan: reap it
        except ChildProcessError:
            pass
        return True

    def _wait_gone(self, procs, timeout):
        deadline = time.monotonic() + timeout
        alive = list(procs)
        while True:
            alive = [p for p in alive if not self._gone(p)]
            # A second signal to bpslaunch means "stop now": skip the rest of the wait.
            if not alive or time.monotonic() >= deadline or self._signal_count > 1:
                return alive
            time.sleep(POLL_INTERVAL)

    @staticmethod
    def _send(procs, sig):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def teardown(self):
        """End every child and descendant (SIGTERM, then SIGKILL after TERM_TIMEOUT), drain
        the output and remove the temporary directory. Idempotent."""
        if self._torn_down:
            return
        self._torn_down = True
        try:
            procs = self._descendants()
            if procs:
                self._send(procs, signal.SIGTERM)
                alive = self._wait_gone(procs, TERM_TIMEOUT)
                # Processes that appeared meanwhile (or were adopted) go down with the rest.
                alive += [p for p in self._descendants() if p not in alive and not self._gone(p)]
                if alive:
                    _say(f"killing {len(alive)} process(es) still alive {TERM_TIMEOUT:g}s after SIGTERM")
                    self._send(alive, signal.SIGKILL)
                    self._wait_gone(alive, TERM_TIMEOUT)
        finally:
            for c in self.children:
                try:
                    c.popen.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
                log.logger.info("%s (pid %d) exit code %s", c.tag, c.pid, c.code)
            deadline = time.monotonic() + DRAIN_TIMEOUT
            for c in self.children:
                self._drain(c, max(0.0, deadline - time.monotonic()))
            if self.tmpdir is not None:
                shutil.rmtree(self.tmpdir, ignore_errors=True)

    @staticmethod
    def _drain(child, timeout):
        deadline = time.monotonic() + timeout
        for t in child.readers:
            t.join(max(0.0, deadline - time.monotonic()))


def _read_port(path):
    """The port in the scheduler's port file, or None while it is not there (yet)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    if not text.endswith("\n"):
        return None  # not complete yet (the scheduler renames it into place, but be safe)
    try:
        port = int(text.strip(), 10)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise JobStopped(1, f"scheduler wrote a malformed port {text.strip()!r} to {path}")
    return port


# ---------------------------------------------------------------------------------------
# The two modes: each validates first (ConfigError -> exit 2), then returns a function
# that runs the job.


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


def _thread_env(env, procs):
    """Default OMP_NUM_THREADS to CPUs / worker processes on this machine, as torchrun does.

    Each worker's framework thread pool otherwise sizes itself to the whole machine; on the
    2-core CI machine that made the example job 20x slower.
    """
    if not env.get("OMP_NUM_THREADS", "").strip():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // procs))


def _plan_local(opts, command):
    if not command:
        raise ConfigError("--local needs a command to run on the workers (bpslaunch --local ... -- CMD)")
    # a Summation Service on every worker machine (the design's k = 0): the summing is spread over
    # them; on one host, 2 single-process machines with 2 servers took 1.2-1.4x less time than with one
    # server at 64 MB, and 4 with 4 the same as one (docs/benchmarks.md, "Servers per worker machine")
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
    _thread_env(base, nw * nl)

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
            _say(f"warning: DMLC_ROLE={cfg.role} ignores the command {' '.join(command)!r}")
        argv = SCHEDULER_ARGV if cfg.role == "scheduler" else SERVER_ARGV
        env = dict(os.environ, PYTHONUNBUFFERED="1")

        def run_service(job):
            job.spawn(cfg.role, argv, env, stdin=subprocess.DEVNULL)
            return job.wait()

        return run_service

    if not command:
        raise ConfigError("DMLC_ROLE=worker needs a command to run (bpslaunch [options] CMD ...)")

    _thread_env(env, cfg.local_size)

    def run_workers(job):
        for j in range(cfg.local_size):
            job.spawn(f"worker {cfg.worker_id}.{j}", command,
                      dict(env, BYTEPS_LOCAL_RANK=str(j), BYTEPS_LOCAL_SIZE=str(cfg.local_size)))
        return job.wait()

    return run_workers


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
        _thread_env(base, int(task.env["BYTEPS_LOCAL_SIZE"]))
    else:
        config.load(dict(base, DMLC_ROLE="server"))
    host = task.hosts[task.node]
    parts = (["scheduler"] if task.scheduler else []) + ([f"{task.server} server"] if task.server else []) + \
        ([f"worker {task.worker_id}, local ranks {list(task.local_ranks)}"] if task.local_ranks else [])
    _say(f"slurm: node {task.node} ({host}) of {list(task.hosts)}: "
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


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _positive_int(text):
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _parser():
    p = argparse.ArgumentParser(
        prog="bpslaunch", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG,
        description="Launch the processes of a byteps job: a whole job on one machine (--local), "
                    "or this machine's part of a multi-machine job, by DMLC_ROLE (role mode).")
    p.add_argument("--local", action="store_true",
                   help="run scheduler, servers and workers on this machine")
    p.add_argument("--workers", type=_positive_int, metavar="W",
                   help="worker machines to simulate (--local only; required there)")
    p.add_argument("--servers", type=_positive_int, metavar="S",
                   help="Summation Service servers (--local only; default W, one per worker machine)")
    p.add_argument("--local-size", type=_positive_int, metavar="L",
                   help="processes of CMD per worker machine (default 1 with --local; in role "
                        "mode overrides BYTEPS_LOCAL_SIZE)")
    p.add_argument("--slurm", action="store_true",
                   help="run this Slurm task's part of the job (under srun): roles, ranks and the scheduler "
                        "address from SLURM_* (docs/slurm.md)")
    p.add_argument("--server-nodes", type=int, default=0, metavar="K",
                   help="--slurm: the step's last K nodes run only a standalone server (default 0)")
    p.add_argument("--k8s", action="store_true",
                   help="run this Kubernetes pod's role: DMLC_WORKER_ID from the pod index, DMLC_NODE_HOST "
                        "from POD_IP (docs/kubernetes.md)")
    p.add_argument("--timeout", type=_positive_float, metavar="SEC",
                   help="wall-clock limit for the whole job; on expiry everything is stopped "
                        "and bpslaunch exits 124")
    p.add_argument("--grace", type=float, default=30.0, metavar="SEC",
                   help="after all workers succeeded, how long the scheduler and servers may "
                        "take to exit on their own before they are terminated (default 30)")
    p.add_argument("--timeline", metavar="PATH",
                   help="write one Chrome/Perfetto trace of the whole job to PATH (sets BYTEPS_TIMELINE for every "
                        "process; docs/timeline.md)")
    p.add_argument("--no-prefix", dest="prefix", action="store_false",
                   help="pass the children's output through unchanged instead of prefixing "
                        "each line with its process tag")
    diag = p.add_argument_group("placement diagnostics (byteps.placement.plan; starts nothing)")
    diag.add_argument("--plan", action="store_true",
                      help="print the optimal k/n split of the BytePS paper (Eq. 1-7): bytes each server "
                           "sums, bytes each machine sends and receives, t_opt, gamma_a, gamma_p")
    diag.add_argument("--worker-machines", type=_positive_int, default=None, metavar="N",
                      help="worker machines, each with a colocated server (--plan; default DMLC_NUM_WORKER)")
    diag.add_argument("--extra", type=int, default=0, metavar="K",
                      help="extra machines, each with a standalone server (--plan; default 0)")
    diag.add_argument("--model-bytes", default="256MB", metavar="SIZE",
                      help="bytes pushed per step, e.g. 64MB, 256MiB (--plan; default 256MB)")
    diag.add_argument("--bandwidth", default="10Gbit", metavar="RATE",
                      help="each machine's NIC rate per direction, e.g. 100Mbit, 25Gbit (--plan; default 10Gbit)")
    diag.add_argument("--latency", default="100us", metavar="TIME",
                      help="round trip between machines, e.g. 50us, 2ms (--plan: the partition size and "
                           "credit of byteps/autotune.py; default 100us)")
    p.add_argument("--stages", action="store_true",
                   help="print the pipeline stage list of a partition in each situation (core/stages.py), "
                        "with BYTEPS_PIPELINE applied; --local-size sets the processes per machine (default 2)")
    p.add_argument("--topology", nargs="?", const="", default=None, metavar="FILE",
                   help="print the intra-machine aggregation plan of docs/topology.md (strategy and why, "
                        "per-link traffic, J, x*, ring all-reduce) for this machine, or for a machine "
                        "description FILE or fixture name, and exit; --local-size sets the processes")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD ...",
                   help="the worker command and its arguments (put -- before it)")
    return p


#: a lone CMD containing one of these is a shell command line (BytePS's ``bpslaunch "python3 train.py"``)
_SHELL_CHARS = frozenset(" \t\n;&|<>()$`'\"*?~")


def _parse(argv):
    parser = _parser()
    opts = parser.parse_args(argv)
    command = list(opts.command)
    if command and command[0] == "--":
        command = command[1:]
    if len(command) == 1 and any(c in command[0] for c in _SHELL_CHARS):
        command = ["/bin/sh", "-c", command[0]]  # BytePS: one quoted command string, run by a shell
    if sum((opts.local, opts.slurm, opts.k8s)) > 1:
        parser.error("--local, --slurm and --k8s are different modes; give one")
    if opts.server_nodes and not opts.slurm:
        parser.error("--server-nodes only applies with --slurm")
    if opts.server_nodes < 0:
        parser.error("--server-nodes must be >= 0")
    if opts.local and opts.workers is None:
        parser.error("--local needs --workers W")
    if not opts.local and (opts.workers is not None or opts.servers is not None):
        parser.error("--workers/--servers only apply with --local (role mode reads DMLC_NUM_WORKER/"
                     "DMLC_NUM_SERVER)")
    if opts.grace < 0:
        parser.error("--grace must be >= 0")
    return opts, command


def _print_plan(opts):
    """bpslaunch --plan: the k/n placement of byteps.placement.plan for the given job shape, and the
    partition size and credit byteps/autotune.py chooses for it."""
    from . import autotune, placement

    try:
        n = opts.worker_machines or int(os.environ.get("DMLC_NUM_WORKER", "0") or 0)
        if n < 1 or opts.extra < 0:
            raise ValueError("--plan needs --worker-machines N >= 1 (or DMLC_NUM_WORKER) and --extra K >= 0")
        plan = placement.plan(n, opts.extra, placement.parse_bytes(opts.model_bytes),
                              placement.parse_rate(opts.bandwidth))
        rtt = autotune.parse_duration(opts.latency)
    except ValueError as e:
        _say(f"error: {e}")
        return 2
    print(plan.table())
    print(autotune.plan_text(plan, rtt))
    return 0


def _print_stages(opts):
    """bpslaunch --stages: the stage lists core/stages.py builds, as the engine would for this environment."""
    from byteps.core import stages

    try:
        print(stages.situations_text(opts.local_size or 2))
    except ConfigError as e:
        _say(f"error: {e}")
        return 2
    return 0


def _print_topology(opts):
    """bpslaunch --topology [FILE]: the §4.2.3 plan for this machine or a description (docs/topology.md)."""
    from .topology import TopologyError, plan_text

    try:
        print(plan_text(opts.topology or None, local_size=opts.local_size))
    except TopologyError as e:
        _say(f"error: {e}")
        return 2
    return 0


def main(argv=None):
    """Entry point of ``bpslaunch`` / ``python -m byteps.launcher``; returns the exit status.

    It owns its process: children, adopted orphans and signal handlers are managed as if
    bpslaunch were the only thing running in it.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        opts, command = _parse(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    if opts.plan:
        return _print_plan(opts)
    if opts.topology is not None:
        return _print_topology(opts)
    if opts.stages:
        return _print_stages(opts)
    if opts.timeline:  # every child inherits it; the scheduler (ours or a role-mode one) writes the file
        os.environ["BYTEPS_TIMELINE"] = os.path.abspath(opts.timeline)
    try:
        plan = _plan_local if opts.local else _plan_slurm if opts.slurm else _plan_k8s if opts.k8s else _plan_role
        run = plan(opts, command)
    except ConfigError as e:
        _say(f"error: {e}")
        return 2
    log.setup("launcher")
    with Job(prefix=opts.prefix, timeout=opts.timeout, grace=opts.grace) as job:
        try:
            return run(job)
        except JobStopped as stop:
            _say(stop.reason)
            return stop.code


if __name__ == "__main__":
    sys.exit(main())
