"""examples/kubernetes/: every object loads into the Kubernetes API models, and the pods'
environments make a consistent byteps job through ``bpslaunch --k8s`` (byteps/cluster_env.py).

No cluster is needed: the ``kubernetes`` client's models deserialize each manifest offline (with
client-side validation of required fields); serializing the model back must give the manifest again,
so a misspelled or misplaced field (which the deserializer would drop) fails the test.
"""
import glob
import time
import json
import os

import pytest

from byteps import cluster_env, config
from byteps.errors import ConfigError

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (pip install kubernetes; in the test "
                                                      "extra) validates the manifests")
yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFESTS = sorted(glob.glob(os.path.join(ROOT, "examples", "kubernetes", "*.yaml")))
MODELS = {("v1", "ConfigMap"): "V1ConfigMap", ("v1", "Service"): "V1Service", ("v1", "Secret"): "V1Secret",
          ("batch/v1", "Job"): "V1Job", ("apps/v1", "StatefulSet"): "V1StatefulSet",
          ("apps/v1", "Deployment"): "V1Deployment"}


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _normal(obj):
    """Quantities and ports written as YAML ints/strings compare as text; empty values are dropped."""
    if isinstance(obj, dict):
        return {k: _normal(v) for k, v in obj.items() if v not in (None, [], {})}
    if isinstance(obj, list):
        return [_normal(v) for v in obj]
    return str(obj) if isinstance(obj, (int, float)) and not isinstance(obj, bool) else obj


@pytest.fixture(scope="module")
def objects():
    assert MANIFESTS, "examples/kubernetes/*.yaml is missing"
    api = kubernetes.client.ApiClient()
    out = []
    for path in MANIFESTS:
        for doc in load(path):
            key = (doc.get("apiVersion"), doc.get("kind"))
            assert key in MODELS, f"{os.path.basename(path)}: unexpected object {key}"
            model = api.deserialize(json.dumps(doc), MODELS[key], "application/json")
            back = api.sanitize_for_serialization(model)
            assert _normal(back) == _normal(doc), f"{path}: {key} {doc['metadata']['name']} changed in the round trip"
            out.append((doc, model))
    return out


def by_name(objects, kind, name):
    (model,) = [m for d, m in objects if d["kind"] == kind and d["metadata"]["name"] == name]
    return model


def test_every_object_loads_with_its_required_fields(objects):
    kinds = sorted({d["kind"] for d, _ in objects})
    assert kinds == ["ConfigMap", "Job", "Secret", "Service"]
    for doc, model in objects:
        assert model.metadata.name and model.metadata.labels.get("byteps.io/job") == "byteps-job"
        if doc["kind"] == "Job":
            spec = model.spec.template.spec
            assert model.spec.completion_mode == "Indexed" and model.spec.backoff_limit == 0
            assert spec.subdomain == "byteps-job" and spec.restart_policy == "Never"
            for c in (spec.containers or []) + (spec.init_containers or []):
                assert c.name and c.image and c.command[:2] == ["bpslaunch", "--k8s"]


def test_the_headless_service_selects_every_pod(objects):
    svc = by_name(objects, "Service", "byteps-job")
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses
    for doc, model in objects:
        if doc["kind"] == "Job":
            labels = model.spec.template.metadata.labels
            assert all(labels.get(k) == v for k, v in svc.spec.selector.items()), doc["metadata"]["name"]


def pod_envs(objects, job_name, index, pod_ip):
    """The environment of each container of pod ``index`` of ``job_name``, as the kubelet would build it
    (ConfigMap via envFrom, downward API, Secret, JOB_COMPLETION_INDEX, the pod's hostname)."""
    cm = by_name(objects, "ConfigMap", "byteps-job").data
    secret = by_name(objects, "Secret", "byteps-job")
    job = by_name(objects, "Job", job_name)
    spec = job.spec.template.spec
    envs = {}
    for c in (spec.init_containers or []) + spec.containers:
        env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{job_name}-{index}"}
        for src in c.env_from or []:
            assert src.config_map_ref.name == "byteps-job"
            env.update(cm)
        for var in c.env:
            if var.value is not None:
                env[var.name] = var.value
            elif var.value_from.field_ref is not None:
                assert var.value_from.field_ref.field_path == "status.podIP"
                env[var.name] = pod_ip
            else:
                ref = var.value_from.secret_key_ref
                assert ref.name == secret.metadata.name and ref.key in secret.string_data
                env[var.name] = secret.string_data[ref.key]
        env.update(cluster_env.k8s_env(env))
        envs[c.name] = env
    return envs


def test_the_pods_environments_make_one_consistent_job(objects):
    jobs = {n: by_name(objects, "Job", n) for n in ("byteps-scheduler", "byteps-server", "byteps-worker")}
    workers, servers = jobs["byteps-worker"].spec.completions, jobs["byteps-server"].spec.completions
    (sched,) = pod_envs(objects, "byteps-scheduler", 0, "10.1.0.1").values()
    cfg = config.load(dict(sched, DMLC_ROLE="scheduler"))
    assert cfg.role == "scheduler" and cfg.root_uri == "10.1.0.1" and cfg.root_port == 9000  # binds its pod IP
    seen_workers, seen_servers = [], []
    for i in range(servers):
        (env,) = pod_envs(objects, "byteps-server", i, f"10.2.0.{i}").values()
        cfg = config.load(env)
        assert cfg.role == "server" and cfg.node_host == f"10.2.0.{i}" and cfg.server_role == "standalone"
        seen_servers.append(cfg)
    for i in range(workers):
        envs = pod_envs(objects, "byteps-worker", i, f"10.3.0.{i}")
        srv, wrk = config.load(envs["server"]), config.load(dict(envs["worker"], BYTEPS_LOCAL_RANK="0"))
        assert srv.server_role == "colocated" and srv.node_host == wrk.node_host == f"10.3.0.{i}"
        assert wrk.worker_id == i
        seen_workers.append(wrk)
        seen_servers.append(srv)
    # every process agrees on the job's shape, and the shape is what the Jobs start
    for cfg in seen_workers + seen_servers:
        assert (cfg.num_worker, cfg.num_server) == (workers, servers + workers)
        # the scheduler's DNS name: <Job>-<index>.<headless Service>
        assert cfg.root_uri == "byteps-scheduler-0.byteps-job" and cfg.root_port == 9000
        assert cfg.job_id == "byteps-job"
    # placement: standalone servers on CPU nodes, workers on GPU nodes, one per node
    assert jobs["byteps-server"].spec.template.spec.node_selector == {"byteps.io/node-kind": "cpu"}
    assert jobs["byteps-worker"].spec.template.spec.node_selector == {"byteps.io/node-kind": "gpu"}
    for name in ("byteps-server", "byteps-worker"):
        anti = jobs[name].spec.template.spec.affinity.pod_anti_affinity
        (term,) = anti.required_during_scheduling_ignored_during_execution
        assert term.topology_key == "kubernetes.io/hostname"


def test_k8s_env_contract():
    assert cluster_env.k8s_env({"DMLC_ROLE": "worker", "JOB_COMPLETION_INDEX": "3", "POD_IP": "10.0.0.9",
                                "DMLC_NUM_WORKER": "4"}) == \
        {"BYTEPS_LAUNCHER": "kubernetes", "DMLC_NODE_HOST": "10.0.0.9", "DMLC_WORKER_ID": "3"}
    # a StatefulSet pod: the ordinal at the end of its name
    assert cluster_env.k8s_env({"DMLC_ROLE": "worker", "POD_NAME": "train-w-12"})["DMLC_WORKER_ID"] == "12"
    assert cluster_env.k8s_env({"DMLC_ROLE": "scheduler", "POD_IP": "10.0.0.1"})["DMLC_PS_ROOT_URI"] == "10.0.0.1"
    # explicit values win
    assert "DMLC_WORKER_ID" not in cluster_env.k8s_env({"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1"})
    assert "DMLC_NODE_HOST" not in cluster_env.k8s_env({"DMLC_ROLE": "server", "POD_IP": "1.2.3.4",
                                                         "DMLC_NODE_HOST": "5.6.7.8"})
    with pytest.raises(ConfigError, match="needs the pod's role"):
        cluster_env.k8s_env({})
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX"):
        cluster_env.k8s_env({"DMLC_ROLE": "worker", "POD_NAME": "no-ordinal"})
    with pytest.raises(ConfigError, match="index 4 >= DMLC_NUM_WORKER=4"):
        cluster_env.k8s_env({"DMLC_ROLE": "worker", "JOB_COMPLETION_INDEX": "4", "DMLC_NUM_WORKER": "4"})


WORKER_SCRIPT = """\
import json, os, sys
import torch
import byteps.torch as bps
from byteps import common
bps.init()
t = (torch.arange(100_003) % 13 - 6).double() * (bps.rank() + 1)
out = {"rank": bps.rank(), "sum": bps.push_pull(t, average=False, name="t").tolist()[:13],
       "roles": [s["role"] for s in common.metrics()["servers"]],
       "weights": [s["weight"] for s in common.metrics()["servers"]]}
bps.shutdown()
json.dump(out, open(os.path.join(sys.argv[1], f"w{out['rank']}.json"), "w"))
"""


def test_the_manifests_job_runs_with_bpslaunch_k8s(objects, tmp_path):
    """Every container of the manifests as a real `bpslaunch --k8s` process on this machine: each pod gets
    its own loopback address as POD_IP, and the scheduler's DNS name is replaced by its address."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "train.py"
    script.write_text(WORKER_SCRIPT)
    pods = [("byteps-scheduler", 0, "127.0.0.10")] + [("byteps-server", i, f"127.0.0.{20 + i}") for i in range(1)] \
        + [("byteps-worker", i, f"127.0.0.{30 + i}") for i in range(2)]
    procs = []
    try:
        for job, index, ip in pods:
            for name, env in pod_envs(objects, job, index, ip).items():
                # the kubelet's environment, before bpslaunch --k8s derives its part again for real
                env = {**os.environ, **{k: v for k, v in env.items()
                                         if k not in ("DMLC_NODE_HOST", "DMLC_WORKER_ID", "BYTEPS_LAUNCHER")}}
                env.update(DMLC_PS_ROOT_PORT=port, OMP_NUM_THREADS="1", BYTEPS_TIMEOUT="60", PYTHONUNBUFFERED="1")
                if job != "byteps-scheduler":
                    env["DMLC_PS_ROOT_URI"] = "127.0.0.10"  # the scheduler's DNS name does not resolve here
                argv = [sys.executable, "-m", "byteps.launcher", "--k8s"]
                if name == "worker":
                    argv += ["--", sys.executable, str(script), str(tmp_path)]
                log = open(tmp_path / f"{job}-{index}-{name}.log", "wb")
                procs.append((f"{job}-{index}/{name}", subprocess.Popen(argv, env=env, stdout=log,
                                                                       stderr=subprocess.STDOUT)))
        deadline = time.monotonic() + 120
        for tag, p in procs:
            try:
                code = p.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = "timeout"
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(tmp_path.glob("*.log")))
            assert code == 0, f"{tag} exited {code}\n{logs}"
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    res = [json.load(open(tmp_path / f"w{r}.json")) for r in range(2)]
    for r in res:
        assert r["sum"] == [((i % 13) - 6) * 3.0 for i in range(13)]
        # n = 2, k = 1 (Eq. 1-2): the standalone server sums 2/4, each colocated one 1/4
        assert sorted(zip(r["roles"], r["weights"])) == [("colocated", 1), ("colocated", 1), ("standalone", 2)]
