"""The worker's native data plane (core/bps_worker.h, core/_worker_core.pyx) against the Python engine.

Every job here is real (scheduler, servers and workers as processes on 127.0.0.1); sums are compared
bit for bit with locally computed ones by test_push_pull.check_matrix.
"""
import pytest

from byteps.core import _worker_core
from test_push_pull import SMALL_SHAPES, check_matrix

pytestmark = pytest.mark.skipif(not _worker_core.available, reason="the native core needs pyzmq's libzmq "
                                                                   "as a shared object")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ipc", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_exact_sums_through_either_engine(cluster, native, ipc):
    """Every dtype and shape, partitions below and above the zero-copy size, through shared memory
    and TCP; the native path really ran (or really did not)."""
    res = check_matrix(cluster, 2, 2, SMALL_SHAPES + [(3, 70001)], rounds=2, extreme=False, ipc=ipc,
                       extra_env={"BYTEPS_PARTITION_BYTES": "300000", "BYTEPS_NATIVE": native})
    for r, v in res.items():
        assert (v["native_ops"] > 0) == (native == "1"), (r, v["native_ops"])



@pytest.mark.timeout(120)
def test_poll_never_reports_done_before_the_sum(cluster):
    """poll() right after starting a new tensor: done only once the sum is in the tensor (a native op's
    id must not be visible before the native core holds the op, which reads unknown ids as finished)."""
    c = cluster(2, 1)
    c.run_workers("poll_race", {"ops": 150, "elems": 3000})
    codes, scodes, sched = c.wait_all(90)
    assert codes == [0, 0], c.all_logs()
    for r, v in c.results().items():
        assert v["value"]["early"] == [], (r, v["value"])
        assert v["native_ops"] >= 150, (r, v["native_ops"])
