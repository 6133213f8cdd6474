"""BytePS's torch module paths and calls on a real 2-worker job (tests/scenarios_bps_compat.py);
the references train the same models locally. Two workers, so every float sum is exact (a + b)."""
import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_bps_compat
from conftest import Cluster, Run  # noqa: E402
from scenarios_bps_compat import cb_model, ddp_model, loss_of  # noqa: E402

TIMEOUT = pytest.mark.timeout(240)
N = 2


@pytest.fixture(autouse=True)
def one_thread():
    """The workers run with OMP_NUM_THREADS=1; other thread counts may round matmuls differently."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("bps_compat"), "bps_compat_torch", N, 1,
               env={"BYTEPS_SPEED_WINDOW": "0.3"}, timeout=200)


def _reference_ddp():
    """Every rank starts from rank 0's module; before each forward a rank takes rank 0's buffers;
    gradients are averaged (a no_sync backward adds to the next one's local gradient)."""
    init = ddp_model(0).state_dict()
    models = [ddp_model(r) for r in range(N)]
    for m in models:
        m.load_state_dict(init)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5) for m in models]

    def average_and_step():
        grads = [[p.grad.clone() for p in m.parameters()] for m in models]
        for m, o in zip(models, opts):
            for p, *gs in zip(m.parameters(), *grads):
                p.grad.copy_(sum(gs) / N)
            o.step()

    buffers0 = lambda: [b.clone() for b in models[0].buffers()]  # noqa: E731
    for step in range(3):
        for o in opts:
            o.zero_grad()
        b0 = buffers0()
        for r, m in enumerate(models):
            for b, v in zip(m.buffers(), b0):
                b.copy_(v)
            loss_of(m, r, step).backward()
        average_and_step()
    for o in opts:
        o.zero_grad()
    for step in (10, 11):
        b0 = buffers0()
        for r, m in enumerate(models):
            for b, v in zip(m.buffers(), b0):
                b.copy_(v)
            loss_of(m, r, step).backward()
    average_and_step()
    return [{k: v.tolist() for k, v in m.state_dict().items()} for m in models]


@TIMEOUT
def test_byteps_torch_parallel_ddp(job):
    """byteps.torch.parallel.DistributedDataParallel: rank 0's module at construction, rank 0's
    buffers before each forward, averaged gradients after backward(), no_sync() accumulates."""
    want = _reference_ddp()
    for r, v in enumerate(job.values("ddp")):
        assert v == want[r], r


@TIMEOUT
def test_cross_barrier(job):
    """byteps.torch.cross_barrier.CrossBarrier trains exactly like averaged SGD."""
    model = cb_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        replicas = []
        for r in range(N):
            m = copy.deepcopy(model)
            loss_of(m, r, step).backward()
            replicas.append([p.grad for p in m.parameters()])
        for p, *gs in zip(model.parameters(), *replicas):
            p.grad = sum(gs) / N
        opt.step()
    want = {k: v.tolist() for k, v in model.state_dict().items()}
    for v in job.values("cross_barrier"):
        assert v["params"] == want and v["is_sgd"] and all(v["api"])


@TIMEOUT
def test_suspend_resume_and_pushpull_speed(job):
    for r, v in enumerate(job.values("speed")):
        assert v["first"] == [0, -5.0]
        assert v["second"] == {"ms_recent": True, "positive": True}
        assert v["suspended"] is False
        assert v["resumed"] == {"rank": r, "size": N, "sum": [float(sum(range(1, N + 1)))] * 3}


class _BytePSLaunched(Cluster):
    """The scheduler and servers started as BytePS's launcher does: ``python3 -c 'import byteps.server'``."""

    def _spawn(self, argv, role, extra=None, log=None):
        if role in ("scheduler", "server"):
            argv = [sys.executable, "-c", "import byteps.server"]
        return super()._spawn(argv, role, extra, log)


@TIMEOUT
def test_import_byteps_server_runs_the_service(tmp_path):
    c = _BytePSLaunched(str(tmp_path), 2, 2).start()
    try:
        c.run_workers("bps_tiny")
        codes, server_codes, sched_code = c.wait_all(60)
        assert codes == [0, 0] and server_codes == [0, 0] and sched_code == 0, c.all_logs()
        res = c.results()
        for r in range(2):
            assert res[r]["value"] == {"sum": [0.0, 3.0, 6.0, 9.0], "bcast": [1.0, 1.0]}, res[r]
    finally:
        c.kill_all()


@TIMEOUT
def test_single_machine_mode_needs_no_scheduler(tmp_path):
    """BytePS's single-machine tutorial: DMLC_NUM_WORKER=1, two local processes, no scheduler or
    server started and no DMLC_PS_ROOT_URI: ``bpslaunch "python3 train.py"`` runs the job (its own
    scheduler and server, so the processes' sums are exact) instead of waiting for a scheduler."""
    from conftest import FAST_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(FAST_ENV, DMLC_ROLE="worker", DMLC_NUM_WORKER="1", DMLC_WORKER_ID="0", BYTEPS_LOCAL_SIZE="2")
    line = f"{sys.executable} {os.path.join(HERE, 'scenarios.py')} bps_tiny {tmp_path} {{}}"
    bpslaunch = os.path.join(os.path.dirname(sys.executable), "bpslaunch")
    t0 = time.monotonic()
    r = subprocess.run([bpslaunch, line], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.monotonic() - t0 < 60
    for rank in range(2):
        res = json.loads((tmp_path / f"result.{rank}.json").read_text())
        assert res["size"] == 2 and res["value"] == {"sum": [0.0, 3.0, 6.0, 9.0], "bcast": [1.0, 1.0]}, res
