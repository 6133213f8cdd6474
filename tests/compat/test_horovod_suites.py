"""Horovod's own test files (test/parallel/test_torch.py, test_tensorflow.py), unmodified, on byteps.

Each job runs the pinned file as ``horovodrun -np N pytest -v`` would, on 2 ranks (one machine) and on 4
(2 "machines" of 2 processes, all on 127.0.0.1), through tests/compat/harness.py;
every rank's outcome is checked against tests/compat/expected.py: the same tests fail (each for its
listed reason) and skip, the rest pass, and no rank is left unfinished. Marked ``compat`` (minutes per
job): ``make test-compat`` runs them; test_tensorflow.py on 4 ranks takes about 35 minutes on a loaded
2-core machine, so it is marked ``compat_long`` instead (``make test-compat-long``; CI runs both). Without
the pinned files they skip, saying where they looked.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find harness / expected
import expected  # noqa: E402
import harness  # noqa: E402

# (suite, ranks, processes per "machine", marker)
JOBS = [("torch", 2, 2, pytest.mark.compat), ("torch", 4, 2, pytest.mark.compat),
        ("tensorflow", 2, 2, pytest.mark.compat), ("tensorflow", 4, 2, pytest.mark.compat_long)]


def _expectation(suite, ranks):
    """expected.py's lists for a job of ``ranks`` ranks: "failed_from" entries join "failed" from their rank count."""
    want = {"torch": expected.TORCH, "tensorflow": expected.TENSORFLOW}[suite]
    failed = {**want["failed"], **{t: why for t, (least, why) in want.get("failed_from", {}).items() if ranks >= least}}
    return {"failed": failed, "skipped": want["skipped"]}


@pytest.mark.timeout(3900)
@pytest.mark.parametrize("suite,ranks,local_size", [pytest.param(*job[:3], marks=job[3], id=f"{job[0]}-{job[1]}ranks")
                                                    for job in JOBS])
def test_horovod_file_on_byteps(tmp_path, suite, ranks, local_size):
    pinned, why = harness.compat_dir()
    if pinned is None:
        pytest.skip(why)
    # the TensorFlow file takes about 13 minutes on 2 ranks and 35 on 4 on a loaded 2-core machine: room for a
    # slower one
    deadline = {"tensorflow": 1800 * ranks // 2 + 200}.get(suite, 1200)
    results = harness.run_suite(suite, str(tmp_path), ranks, local_size, timeout=deadline, pinned=pinned)
    want = _expectation(suite, ranks)
    report = []
    for res in results:
        where = f"rank {res.rank} (log {res.log_path})"
        if res.code is None:
            report.append(f"{where}: still running at the deadline; last lines:\n{res.log[-2000:]}")
            continue
        if not res.tests:
            report.append(f"{where}: exit {res.code}, no test ran:\n{res.log[-3000:]}")
            continue
        failing = res.failing()
        unexpected = sorted(failing - set(want["failed"]))
        fixed = sorted(set(want["failed"]) - failing)
        skipped = res.with_status("SKIPPED")
        if unexpected:
            report.append(f"{where}: unexpected failures {unexpected}")
        if fixed:
            report.append(f"{where}: listed as failing but did not fail (update tests/compat/expected.py and "
                          f"docs/compat.md): {fixed}")
        if skipped != set(want["skipped"]):
            report.append(f"{where}: skipped {sorted(skipped ^ set(want['skipped']))} differ from the list")
    assert not report, "\n".join(report)
    assert len({frozenset(r.tests) for r in results}) == 1, "the ranks ran different tests"
