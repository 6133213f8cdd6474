"""bpslaunch --slurm: the SLURM_* -> DMLC_* contract, then a real Slurm when one can start.

The contract tests feed byteps.cluster_env recorded task environments (the first ones were printed by
srun on the one-machine Slurm below). The real tests start a slurmctld and three slurmd (Slurm's
"multiple slurmd" mode: three nodes, bpsn1-3, on this machine; Debian's slurm-wlm 22.05, auth/none)
from a generated slurm.conf, run byteps jobs through srun and sbatch, and always stop the daemons.
They are skipped, with the reason, when the Slurm binaries are missing (``apt-get install
slurm-wlm``; see docs/slurm.md) or the daemons do not come up (they need root).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from byteps import cluster_env
from byteps.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# srun -N2 --ntasks-per-node=1 on the test Slurm, task 1 (as printed by `env`)
SRUN_NODE_TASK = {"SLURMD_NODENAME": "node2", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node[1-2]",
                  "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
                  "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]",
                  "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)"}


def gpu_cluster_task(node, local_id, nodename=True):
    """srun --ntasks-per-node=4 on 4 GPU nodes + 2 CPU nodes (the last two), as Slurm would set it."""
    hosts = ["gpu001", "gpu002", "gpu003", "gpu010", "cpu-a1", "cpu-a2"]
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_JOB_NODELIST": "cpu-a[1-2],gpu[001-003,010]",
           "SLURM_STEP_NODELIST": "gpu[001-003,010],cpu-a[1-2]", "SLURM_STEP_TASKS_PER_NODE": "4(x6)",
           "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local_id), "SLURM_PROCID": str(4 * node + local_id)}
    if nodename:
        env["SLURMD_NODENAME"] = hosts[node]
    return env


def test_nodelist_expansion():
    assert cluster_env.expand_nodelist("node[1-2]") == ["node1", "node2"]
    assert cluster_env.expand_nodelist("gpu[001-003,010],cpu-a[1-2]") == \
        ["gpu001", "gpu002", "gpu003", "gpu010", "cpu-a1", "cpu-a2"]
    assert cluster_env.expand_nodelist("n[08-10]") == ["n08", "n09", "n10"]
    assert cluster_env.expand_nodelist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert cluster_env.expand_nodelist("single") == ["single"]
    assert cluster_env.expand_tasks_per_node("4(x2),1") == [4, 4, 1]
    for bad in ("n[1-", "n]1[", "n[3-1]", "n[a-b]", ""):
        with pytest.raises(ConfigError, match="Slurm node list"):
            cluster_env.expand_nodelist(bad)


def test_one_task_per_node():
    task = cluster_env.slurm_task(SRUN_NODE_TASK, local_size=2)
    assert task.hosts == ("node1", "node2") and task.node == 1 and not task.scheduler
    assert task.server == "colocated" and task.local_ranks == (0, 1)
    env = task.env
    assert env["DMLC_NUM_WORKER"] == "2" and env["DMLC_WORKER_ID"] == "1" and env["DMLC_NUM_SERVER"] == "2"
    assert env["DMLC_PS_ROOT_URI"] == "node1" and env["BYTEPS_LOCAL_SIZE"] == "2"
    assert env["BYTEPS_JOB_ID"] == "slurm-1.0"
    first = cluster_env.slurm_task(dict(SRUN_NODE_TASK, SLURMD_NODENAME="node1", SLURM_NODEID="0"), local_size=2)
    assert first.scheduler and first.env["DMLC_PS_ROOT_PORT"] == env["DMLC_PS_ROOT_PORT"]  # every task agrees
    # GPUs on the node set the local size when nothing else does
    assert cluster_env.slurm_task(dict(SRUN_NODE_TASK, SLURM_GPUS_ON_NODE="4")).local_ranks == (0, 1, 2, 3)
    # the last node only sums
    srv = cluster_env.slurm_task(SRUN_NODE_TASK, server_nodes=1)
    assert srv.server == "standalone" and srv.local_ranks == () and "DMLC_WORKER_ID" not in srv.env
    assert srv.env["DMLC_NUM_WORKER"] == "1" and srv.env["DMLC_NUM_SERVER"] == "2"


def test_one_task_per_worker_process_with_server_nodes():
    tasks = {(n, l): cluster_env.slurm_task(gpu_cluster_task(n, l), server_nodes=2) for n in range(6) for l in range(4)}
    assert [k for k, t in tasks.items() if t.scheduler] == [(0, 0)]
    assert {k: t.server for k, t in tasks.items() if t.server} == \
        {(0, 0): "colocated", (1, 0): "colocated", (2, 0): "colocated", (3, 0): "colocated",
         (4, 0): "standalone", (5, 0): "standalone"}
    workers = sorted((int(t.env["DMLC_WORKER_ID"]), r) for t in tasks.values() for r in t.local_ranks)
    assert workers == [(w, r) for w in range(4) for r in range(4)]  # each (machine, local rank) exactly once
    assert tasks[(4, 1)].local_ranks == () and not tasks[(4, 1)].server  # a spare task on a server node
    envs = {json.dumps({k: v for k, v in t.env.items() if k != "DMLC_WORKER_ID"}, sort_keys=True)
            for t in tasks.values()}
    assert len(envs) == 1  # every task agrees on the job: 4 workers of 4 processes, 6 servers, one scheduler
    env = tasks[(0, 0)].env
    assert (env["DMLC_NUM_WORKER"], env["DMLC_NUM_SERVER"], env["BYTEPS_LOCAL_SIZE"]) == ("4", "6", "4")
    assert env["DMLC_PS_ROOT_URI"] == "gpu001" and env["BYTEPS_JOB_ID"] == "slurm-4242.3"
    # without SLURMD_NODENAME the node comes from SLURM_NODEID
    assert cluster_env.slurm_task(gpu_cluster_task(3, 2, nodename=False), server_nodes=2).env["DMLC_WORKER_ID"] == "3"
    # overrides win
    over = cluster_env.slurm_task(dict(gpu_cluster_task(1, 0), DMLC_PS_ROOT_URI="10.0.0.1", DMLC_PS_ROOT_PORT="9000",
                                       BYTEPS_JOB_ID="mine"))
    assert over.env["DMLC_PS_ROOT_URI"] == "10.0.0.1" and over.env["DMLC_PS_ROOT_PORT"] == "9000"
    assert "BYTEPS_JOB_ID" not in over.env


@pytest.mark.parametrize("env, kw, match", [
    ({}, {}, "SLURM_JOB_NODELIST is not set"),
    (dict(SRUN_NODE_TASK, SLURMD_NODENAME="other"), {}, "not in the step's node list"),
    (SRUN_NODE_TASK, {"server_nodes": 2}, "leaves no worker node"),
    (dict(SRUN_NODE_TASK, SLURM_STEP_TASKS_PER_NODE="2,1"), {}, "same number of tasks on every worker node"),
    (dict(SRUN_NODE_TASK, SLURM_STEP_TASKS_PER_NODE="2(x2)"), {"local_size": 3}, "disagrees"),
    (dict(SRUN_NODE_TASK, SLURM_STEP_TASKS_PER_NODE="1(x3)"), {}, "describes 3 nodes"),
])
def test_bad_slurm_environments_are_named(env, kw, match):
    with pytest.raises(ConfigError, match=match):
        cluster_env.slurm_task(env, **kw)


def test_bpslaunch_slurm_outside_slurm_is_a_usage_error():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    p = subprocess.run([sys.executable, "-m", "byteps.launcher", "--slurm", "--", "true"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "SLURM_JOB_NODELIST is not set" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "byteps.launcher", "--server-nodes", "1", "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--server-nodes only applies with --slurm" in p.stderr


# ------------------------------------------------------------------------------------ a real Slurm

NODES = ["bpsn1", "bpsn2", "bpsn3"]


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


SLURM_CONF = """\
ClusterName=bpstest
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=bpsn[1-3] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{p1}-{p3}] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=bpsn[1-3] Default=YES MaxTime=INFINITE State=UP
"""


def _tail(path, n=20):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in ("slurmctld", "slurmd", "srun", "sbatch", "sinfo") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing; apt-get install slurm-wlm, "
                    "see docs/slurm.md)")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm runs its daemons as root (SlurmUser=root); not root here")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ["state"] + [f"spool-{n}" for n in NODES]:
        (d / sub).mkdir()
    ports = _free_ports(5)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(d=d, ctld=ports[0], slurmd=ports[1], p1=ports[2], p3=ports[2] + 2))
    if not all(_port_free(p) for p in (ports[2] + 1, ports[2] + 2)):
        pytest.skip("the three consecutive slurmd ports are not free")
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs = [subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)]
    try:
        for n in NODES:
            procs.append(subprocess.Popen(["slurmd", "-D", "-N", n, "-f", str(conf)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True,
                                 timeout=30)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if sorted(states) == NODES and all(s == "idle" for s in states.values()):
                break
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.skip(f"the test Slurm did not come up ({'exited: ' + ', '.join(dead) if dead else states}):\n"
                            f"{_tail(d / 'slurmctld.log')}{_tail(d / 'slurmd-bpsn1.log')}")
            time.sleep(0.5)
        yield {"env": env, "dir": d}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


JOB_SCRIPT = """\
import json, os, sys
import torch
import byteps.torch as bps
from byteps import common
bps.init()
r = bps.rank()
res = {}
for name, n, dtype in (("a", 3, torch.float32), ("b", 200_001, torch.float64), ("c", 70_000, torch.int32)):
    t = (torch.arange(n) % 17 - 8).to(dtype) * (r + 1)
    res[name] = bps.push_pull(t, average=False, name=name).tolist()
servers = common.metrics()["servers"]
info = {"rank": r, "size": bps.size(), "local_rank": bps.local_rank(), "sums": res,
        "weights": [s["weight"] for s in servers], "roles": [s["role"] for s in servers],
        "env": {k: os.environ[k] for k in ("DMLC_WORKER_ID", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "BYTEPS_JOB_ID")}}
bps.shutdown()
with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
    json.dump(info, f)
"""


def _bin_env(slurm, **extra):
    bindir = os.path.dirname(sys.executable)
    env = dict(slurm["env"], PATH=bindir + os.pathsep + slurm["env"].get("PATH", ""), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", BYTEPS_TIMEOUT="60", BYTEPS_JOB_SECRET="slurm-test-secret-0123456789abcdef",
               # the test's node names do not resolve: the scheduler (node bpsn1) is reached at 127.0.0.1
               DMLC_PS_ROOT_URI="127.0.0.1", **extra)
    return env


def test_nodelist_expansion_agrees_with_scontrol(slurm):
    text = "gpu[001-003,010],cpu-a[1-2],rack[1-2]-n[08-09],x"
    out = subprocess.run(["scontrol", "show", "hostnames", text], env=slurm["env"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert cluster_env.expand_nodelist(text) == out.stdout.split()


def test_srun_one_task_per_worker_process_and_a_server_node(slurm, tmp_path):
    """3 nodes x 2 tasks: bpsn1-2 are worker machines of 2 processes, bpsn3 only sums (n = 2, k = 1)."""
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    # each "node" announces its own loopback address, so byteps sees three hosts as on a real cluster
    cmd = ["srun", "-N3", "--ntasks-per-node=2", "--kill-on-bad-exit=1", "bash", "-c",
           'DMLC_NODE_HOST=127.0.0.$((SLURM_NODEID + 1)) exec bpslaunch --slurm --server-nodes 1 -- "$@"', "job",
           sys.executable, str(script), str(tmp_path)]
    p = subprocess.run(cmd, env=_bin_env(slurm), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    for r, info in enumerate(res):
        assert info["size"] == 4 and info["local_rank"] == r % 2
        assert info["env"]["DMLC_WORKER_ID"] == str(r // 2) and info["env"]["DMLC_NUM_SERVER"] == "3"
        assert info["env"]["BYTEPS_JOB_ID"].startswith("slurm-")
        for name, n in (("a", 3), ("b", 200_001), ("c", 70_000)):
            # rank r pushes (i % 17 - 8) * (r + 1): the sum over 4 ranks is 10x
            assert info["sums"][name] == [((i % 17) - 8) * 10 for i in range(n)], name
        # Eq. 1-2, n = 2, k = 1: the server node sums 2/4, each worker node's server 1/4
        assert sorted(zip(info["roles"], info["weights"])) == [("colocated", 1), ("colocated", 1), ("standalone", 2)]
    assert "node 2 (bpsn3) of ['bpsn1', 'bpsn2', 'bpsn3']: standalone server" in p.stderr, p.stderr[-4000:]
    assert "node 0 (bpsn1) of ['bpsn1', 'bpsn2', 'bpsn3']: scheduler, colocated server, worker 0" in p.stderr


def test_sbatch_runs_the_example_batch_script(slurm, tmp_path):
    out = tmp_path / "job.out"
    env = _bin_env(slurm, PYTHON=sys.executable, SCRIPT=os.path.join(ROOT, "examples", "train_synthetic.py"))
    cmd = ["sbatch", "--wait", f"--output={out}", os.path.join(ROOT, "examples", "slurm", "train.sbatch"),
           "--steps", "5", "--hidden", "64", "--batch-size", "64"]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = out.read_text() if out.exists() else ""
    assert p.returncode == 0, p.stdout + p.stderr + log[-4000:]
    assert "final parameters identical on all 2 workers: True" in log, log[-4000:]
    assert "standalone server" in log and "node 2 (bpsn3)" in log, log[-4000:]
