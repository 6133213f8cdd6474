"""The children of one bpslaunch run, and taking them all down together.

Every child of bpslaunch belongs to one :class:`Job`, and every way out (normal end, a failing
child, a signal, ``--timeout``) goes through :meth:`Job.teardown`, which ends the children *and
their descendants*, drains their output and removes the temporary directory.
"""
# Licensed under the Apache License, Version 2.0.
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from . import log, port_file
from .procctl import become_subreaper as _become_subreaper, make_preexec as _make_preexec

POLL_INTERVAL = 0.05  #: seconds between polls of the children
SCHEDULER_START_TIMEOUT = 30.0  #: seconds the scheduler may take to write its port file
TERM_TIMEOUT = 5.0  #: seconds between SIGTERM and SIGKILL at teardown
DRAIN_TIMEOUT = 5.0  #: seconds to wait for the output reader threads after the children are gone

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# One lock for both streams: a child's stdout and stderr lines, and our own, stay whole.
_OUTPUT_LOCK = threading.Lock()


def say(message):
    """Print one of the launcher's own lines on stderr (under the output lock, so it never
    lands inside a child's line)."""
    with _OUTPUT_LOCK:
        sys.stderr.write(f"bpslaunch: {message}\n")
        sys.stderr.flush()


# ---------------------------------------------------------------------------------------
# Children and the job that owns them


def _exit_code(returncode):
    """Popen's returncode as a shell reports it: -N (killed by signal N) becomes 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(code):
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(code - 128).name})"
    return str(code)


def _reap(pid):
    """Collect an exited child's status, if it has exited."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


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
            # our own output may be gone (closed pipe): keep draining so the child never blocks
            with contextlib.suppress(OSError, ValueError), _OUTPUT_LOCK:
                _write(getattr(sys, dest_name), prefix + line)


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
        self._preexisting = {p.pid for p in self._children()}
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
                    say(f"warning: {c.tag} (pid {c.pid}) exited with code {_describe(code)}; the job goes on "
                         "without it (BYTEPS_ELASTIC=1: the scheduler removes a lost server)")
                continue
            if code:
                raise JobStopped(code, f"{c.tag} (pid {c.pid}) exited with code {_describe(code)}; "
                                       "stopping the job")

    def _children(self):
        """Our live child processes, less those the host process had before the job."""
        try:
            return [p for p in psutil.Process().children() if p.pid not in self._preexisting]
        except psutil.Error:
            return []

    def _reap_orphans(self):
        """Collect adopted orphans that exited, so they do not linger as zombies."""
        ours = {c.pid for c in self.children}
        for p in self._children():
            if p.pid not in ours:
                _reap(p.pid)

    def wait_for_port(self, child, path, limit=SCHEDULER_START_TIMEOUT):
        """Wait until `child` (the scheduler) writes its port number into `path`."""
        try:
            port = port_file.wait(path, lambda: child.code is not None, limit, POLL_INTERVAL / 2, self.check)
        except ValueError as e:
            raise JobStopped(1, f"scheduler wrote a {e} to {path}") from None
        except TimeoutError:
            raise JobStopped(1, f"{child.tag} (pid {child.pid}) did not write its port to {path} "
                                f"within {limit:g}s") from None
        if port is None:
            code = child.code
            self._drain(child, 1.0)  # its error output first, then our verdict
            raise JobStopped(code or 1, f"{child.tag} (pid {child.pid}) exited with code "
                                        f"{_describe(code)} before writing its port to {path}; "
                                        "see its output above")
        return port

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
                say(f"warning: {late} still running {self.grace:g}s after the workers finished; "
                     "terminating")
                break
            time.sleep(POLL_INTERVAL)
        return 0

    # -- teardown ---------------------------------------------------------------------
    def _descendants(self):
        """Every live process below us that this job started, at any depth (children we
        adopted as subreaper included; children the host process had before are not)."""
        procs = []
        for k in self._children():
            procs.append(k)
            with contextlib.suppress(psutil.Error):
                procs += k.children(recursive=True)
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
        _reap(proc.pid)  # an adopted orphan
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
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

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
                    say(f"killing {len(alive)} process(es) still alive {TERM_TIMEOUT:g}s after SIGTERM")
                    self._send(alive, signal.SIGKILL)
                    self._wait_gone(alive, TERM_TIMEOUT)
        finally:
            for c in self.children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.popen.wait(timeout=1.0)
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
