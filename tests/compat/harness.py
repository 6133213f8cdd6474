"""Runs third-party test files and examples, unmodified, against byteps.

Horovod's ``test/parallel/test_*.py`` run as ``horovodrun -np N pytest -v FILE`` would: every rank is a
``pytest`` process with the variables horovodrun's Gloo mode sets (``HOROVOD_RANK``, ``HOROVOD_SIZE``,
``HOROVOD_LOCAL_*``, ``HOROVOD_CROSS_*``, the rendezvous address), so rank 0 starts the scheduler and a
server (docs/launchers.md), and ``import horovod.torch`` finds the re-exporting shim in ``shim/``.

The pinned files come from ``$BYTEPS_COMPAT_DIR`` or ``<repository>/../shared/compat`` (see
:func:`compat_dir`). Every rank's outcome is kept, also when a rank fails or hangs: its console log
(``rank<r>.log``, pytest ``-v`` lines written as each test ends, so a killed rank still reports what it
finished) and its junit file (``rank<r>.xml``, written at the end).

Command line: ``python tests/compat/harness.py torch|tensorflow [--ranks 2] [--local-size 2] [--out DIR]``
prints each rank's outcome per test.
"""
import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time

from byteps.procctl import make_preexec  # PR_SET_PDEATHSIG: ranks die with the test run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHIM = os.path.join(HERE, "shim")

SUITES = {"torch": "horovod/test/parallel/test_torch.py", "tensorflow": "horovod/test/parallel/test_tensorflow.py"}

#: per-test limit inside each rank: a test that hangs fails as a time-out instead of stalling the file
TEST_TIMEOUT_S = 300
#: test_tensorflow.py on 4 ranks: its graph-mode loops of broadcasts and allgathers (test_horovod_broadcast_inplace_cpu,
#: test_horovod_grouped_allgather_cpu) spend minutes in TensorFlow's own session-graph extension on 2 loaded cores
TEST_TIMEOUT_S_LONG = 900


def per_test_limit(name, size):
    """The per-test limit of suite ``name`` on ``size`` ranks."""
    return TEST_TIMEOUT_S_LONG if name == "tensorflow" and size > 2 else TEST_TIMEOUT_S


def compat_dir():
    """(folder of the pinned files, None) or (None, why it is missing)."""
    named = os.environ.get("BYTEPS_COMPAT_DIR")
    if named:
        if os.path.isdir(named):
            return named, None
        return None, f"BYTEPS_COMPAT_DIR={named} is not a folder"
    beside = os.path.join(os.path.dirname(ROOT), "shared", "compat")
    if os.path.isdir(beside):
        return beside, None
    return None, (f"the pinned third-party files are not here: set BYTEPS_COMPAT_DIR or put them in {beside} "
                  "(see docs/compat.md)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(pinned, extra=None):
    """This environment without any launcher's variables, plus the shim and fast failure detection."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "HOROVOD_", "OMPI_", "PMI_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (SHIM, ROOT, env.get("PYTHONPATH")) if p),
               BYTEPS_COMPAT_DIR=pinned, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               BYTEPS_HEARTBEAT_INTERVAL="0.2", BYTEPS_HEARTBEAT_TIMEOUT="5", BYTEPS_TIMEOUT="60",
               TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.update(extra or {})
    return env


def horovodrun_env(rank, size, local_size, port):
    """The variables ``horovodrun --gloo`` gives rank ``rank`` (all "machines" on 127.0.0.1)."""
    return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size), "HOROVOD_LOCAL_RANK": str(rank % local_size),
            "HOROVOD_LOCAL_SIZE": str(local_size), "HOROVOD_CROSS_RANK": str(rank // local_size),
            "HOROVOD_CROSS_SIZE": str(size // local_size), "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_HOSTNAME": "127.0.0.1",
            # several "machines": byteps asks where global rank 0 starts its scheduler (docs/launchers.md)
            **({"BYTEPS_SCHEDULER_URI": f"127.0.0.1:{port + 1}"} if size > local_size else {})}


class RankResult:
    """One rank's outcome: ``tests`` maps a test id (``Class::test``) to PASSED/FAILED/SKIPPED/ERROR, plus
    ``subtest_failures`` (``Class::test[subtest]`` of each failed subtest), the exit code (None: killed at the deadline)."""

    def __init__(self, rank, log_path, code):
        self.rank, self.log_path, self.code = rank, log_path, code
        self.log = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
        self.tests, self.subtest_failures = parse_verbose_log(self.log)

    def failing(self):
        return {t for t, s in self.tests.items() if s in ("FAILED", "ERROR")} | self.subtest_failures

    def with_status(self, status):
        return {t for t, s in self.tests.items() if s == status}


_LINE = re.compile(r"^\S*?::(?P<test>[\w:]+(?:\[[^\]]*\])?)(?: \[[^\]]*\]| \([^)]*\))* "
                   r"(?P<status>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS|SUBPASSED|SUBFAILED|SUBSKIPPED)\b")


#: the summary line (-rf) of a failed subtest: unittest subTest(mode) in Horovod's TensorFlow file
_SUBFAILED = re.compile(r"^SUBFAILED\[(?P<sub>[^\]]*)\] \S*?::(?P<test>[\w:]+)")


def parse_verbose_log(text):
    """pytest -v lines -> ({test: status}, {"test[subtest]" of each failed subtest}). A test whose subtest
    failed still reads PASSED on its own line; its subtests show only in the summary at the end."""
    tests, sub_failed = {}, set()
    for line in text.splitlines():
        sub = _SUBFAILED.match(line.strip())
        if sub:
            sub_failed.add(f"{sub.group('test')}[{sub.group('sub')}]")
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        test, status = m.group("test"), m.group("status")
        if not status.startswith("SUB"):
            if status == "ERROR" and tests.get(test) == "PASSED":
                status = "ERROR"  # a tearDown error after the test passed
            tests[test] = status
    return tests, sub_failed


def run_ranks(argv, outdir, size, local_size, pinned, timeout, extra_env=None, cwd=None):
    """Run ``argv`` (``{rank}`` in it is replaced) as ``size`` horovodrun-style ranks; returns their exit codes
    (None for a rank killed at ``timeout``). Console logs go to ``outdir/rank<r>.log``."""
    os.makedirs(outdir, exist_ok=True)
    port = free_port() - 1  # byteps takes the scheduler port as the rendezvous port + 1 (docs/launchers.md)
    procs = []
    for r in range(size):
        env = base_env(pinned, {**horovodrun_env(r, size, local_size, port), **(extra_env or {})})
        log = open(os.path.join(outdir, f"rank{r}.log"), "wb")
        procs.append(subprocess.Popen([a.replace("{rank}", str(r)) for a in argv], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=cwd or outdir, start_new_session=True,
                                      preexec_fn=make_preexec()))  # gone with this process, even if it is killed
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:  # a rank past the deadline, and whatever it started (rank 0's scheduler and server)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)
    return codes


def run_suite(name, outdir, size=2, local_size=2, timeout=900, pinned=None, select=None):
    """Horovod's ``test_<name>.py`` on ``size`` ranks: one :class:`RankResult` per rank. ``select``: a pytest
    ``-k`` expression, to run some of its tests."""
    pinned = pinned or compat_dir()[0]
    test_file = os.path.join(pinned, SUITES[name])
    argv = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts=", "-o",
            f"timeout={per_test_limit(name, size)}", "--rootdir", os.path.dirname(test_file),
            "--junitxml", os.path.join(outdir, "rank{rank}.xml"), "--durations=0", test_file]
    if select:
        argv += ["-k", select]
    codes = run_ranks(argv, outdir, size, local_size, pinned, timeout)
    return [RankResult(r, os.path.join(outdir, f"rank{r}.log"), codes[r]) for r in range(size)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--local-size", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("-k", dest="select", default=None, help="pytest -k expression: run some of the tests")
    args = ap.parse_args()
    pinned, why = compat_dir()
    if pinned is None:
        sys.exit(why)
    out = args.out or os.path.abspath(f"compat-{args.suite}-{args.ranks}")
    t0 = time.monotonic()
    results = run_suite(args.suite, out, args.ranks, args.local_size, args.timeout, pinned, args.select)
    for res in results:
        counts = {s: len(res.with_status(s)) for s in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
        print(f"rank {res.rank}: exit {res.code} {counts} subtest failures {len(res.subtest_failures)}")
        for t in sorted(res.failing()):
            print(f"   failing: {t}")
    print(f"{time.monotonic() - t0:.0f} s; logs in {out}")


if __name__ == "__main__":
    main()
