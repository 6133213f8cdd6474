"""The DMLC_*/BYTEPS_* view of a byteps job from a cluster manager's environment: Slurm and Kubernetes.

Pure functions of an environment mapping (tests feed them recorded environments); ``bpslaunch
--slurm`` and ``bpslaunch --k8s`` (launcher.py) apply them and start this task's processes.
:func:`slurm_task`: docs/slurm.md; :func:`k8s_env`: docs/kubernetes.md.
"""
import dataclasses
import re

from .config import _get
from .errors import ConfigError
from .launch_env import _job_port

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


# ---------------------------------------------------------------------------------------------- Slurm

def _split_top(text, sep=","):
    """Split at ``sep`` outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"malformed Slurm node list {text!r}: unbalanced ']'")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ConfigError(f"malformed Slurm node list {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_one(name):
    """One host expression with zero or more bracket groups: "n[01-02]-ib[1,3]"."""
    m = re.search(r"\[([^\]]*)\]", name)
    if not m:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    values = []
    for item in m.group(1).split(","):
        r = _RANGE.match(item.strip())
        if not r:
            raise ConfigError(f"malformed Slurm node list range {item!r} in {name!r}")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"malformed Slurm node list range {item!r} in {name!r}: {hi} < {lo}")
        width = len(lo)  # zero padding as written: n[08-10] -> n08 n09 n10
        values += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def expand_nodelist(text):
    """Slurm's compact host list ("gpu[01-03,07],cpu-a[1-2]") as host names, in Slurm's order
    (what ``scontrol show hostnames`` prints; tests compare the two on a real Slurm)."""
    hosts = [h for part in _split_top(text.strip()) for h in _expand_one(part)]
    if not hosts:
        raise ConfigError(f"empty Slurm node list {text!r}")
    return hosts


def expand_tasks_per_node(text):
    """SLURM_TASKS_PER_NODE ("4(x2),1") as one count per node: [4, 4, 1]."""
    counts = []
    for part in text.split(","):
        m = re.match(r"^\s*(\d+)(?:\(x(\d+)\))?\s*$", part)
        if not m:
            raise ConfigError(f"malformed SLURM_TASKS_PER_NODE={text!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """What one ``bpslaunch --slurm`` task runs."""

    hosts: tuple            #: the step's nodes, in order
    node: int               #: this task's node index in ``hosts``
    scheduler: bool         #: start the scheduler here
    server: str             #: "" | "colocated" | "standalone": the server this task starts
    local_ranks: tuple      #: worker processes this task starts (BYTEPS_LOCAL_RANK of each)
    env: dict               #: DMLC_*/BYTEPS_* shared by every process this task starts

    @property
    def worker_id(self):
        return self.node


def _need(env, name):
    value = _get(env, name)
    if value is None:
        raise ConfigError(f"{name} is not set: bpslaunch --slurm runs inside a Slurm job step "
                          "(srun ... bpslaunch --slurm -- CMD); see docs/slurm.md")
    return value


def _count(env, name, value=None):
    value = _need(env, name) if value is None else value
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r} is not a non-negative integer")
    return int(value)


def slurm_task(env, server_nodes=0, local_size=None):
    """The processes this Slurm task starts and their shared environment (see the module docstring).

    Args:
        env: the task's environment (SLURM_* as srun sets them, plus any DMLC_*/BYTEPS_* overrides).
        server_nodes: how many of the step's last nodes run only a standalone server.
        local_size: worker processes per node when there is one task per node (default
            BYTEPS_LOCAL_SIZE, else SLURM_GPUS_ON_NODE, else 1).
    """
    hosts = expand_nodelist(env.get("SLURM_STEP_NODELIST") or _need(env, "SLURM_JOB_NODELIST"))
    nodename = _get(env, "SLURMD_NODENAME", "")
    if nodename:
        if nodename not in hosts:
            raise ConfigError(f"SLURMD_NODENAME={nodename!r} is not in the step's node list {hosts}")
        node = hosts.index(nodename)
    else:
        node = _count(env, "SLURM_NODEID")
        if node >= len(hosts):
            raise ConfigError(f"SLURM_NODEID={node} is outside the step's {len(hosts)} nodes")
    if not 0 <= server_nodes < len(hosts):
        raise ConfigError(f"--server-nodes {server_nodes} leaves no worker node among the step's {len(hosts)} "
                          f"nodes {hosts}")
    n = len(hosts) - server_nodes
    tasks_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    tasks = expand_tasks_per_node(tasks_text) if tasks_text.strip() else [1] * len(hosts)
    if len(tasks) != len(hosts):
        raise ConfigError(f"SLURM_TASKS_PER_NODE={tasks_text!r} describes {len(tasks)} nodes, the node list "
                          f"{len(hosts)}")
    local_id = _count(env, "SLURM_LOCALID") if _get(env, "SLURM_LOCALID") else 0
    per_node = set(tasks[:n])
    if len(per_node) != 1:
        raise ConfigError(f"byteps needs the same number of tasks on every worker node, but the step has "
                          f"{dict(zip(hosts[:n], tasks[:n]))} (SLURM_TASKS_PER_NODE={tasks_text!r})")
    t = per_node.pop()
    if t == 1:  # one task per node: this bpslaunch starts the node's worker processes
        if local_size is None:
            raw = (env.get("BYTEPS_LOCAL_SIZE") or env.get("SLURM_GPUS_ON_NODE") or "1").strip()
            local_size = _count(env, "BYTEPS_LOCAL_SIZE", raw) or 1
        local_ranks = tuple(range(local_size))
    else:  # one task per worker process
        if local_size not in (None, t):
            raise ConfigError(f"--local-size {local_size} disagrees with the step's {t} tasks per node")
        local_size = t
        local_ranks = (local_id,)
    first = local_id == 0
    is_worker_node = node < n
    step = f"slurm-{_need(env, 'SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID', '0')}"
    shared = {
        "DMLC_NUM_WORKER": str(n),
        "DMLC_NUM_SERVER": str(len(hosts)),  # a colocated server on each worker node + the server nodes'
        "DMLC_PS_ROOT_URI": _get(env, "DMLC_PS_ROOT_URI", hosts[0]),
        "DMLC_PS_ROOT_PORT": _get(env, "DMLC_PS_ROOT_PORT", str(_job_port(step) + 1)),
        "BYTEPS_LOCAL_SIZE": str(local_size),
        "BYTEPS_LAUNCHER": "slurm",
    }
    if not _get(env, "BYTEPS_JOB_ID"):
        shared["BYTEPS_JOB_ID"] = step
    if is_worker_node:
        shared["DMLC_WORKER_ID"] = str(node)
    return SlurmTask(hosts=tuple(hosts), node=node, scheduler=node == 0 and first,
                     server=("colocated" if is_worker_node else "standalone") if first else "",
                     local_ranks=local_ranks if is_worker_node else (), env=shared)


# ----------------------------------------------------------------------------------------- Kubernetes

def pod_index(env):
    """This pod's index: an indexed Job's JOB_COMPLETION_INDEX, else the StatefulSet ordinal at the end
    of POD_NAME (or HOSTNAME). None when neither says."""
    raw = _get(env, "JOB_COMPLETION_INDEX", "")
    if raw:
        if not raw.isdigit():
            raise ConfigError(f"JOB_COMPLETION_INDEX={raw!r} is not a non-negative integer")
        return int(raw)
    for name in ("POD_NAME", "HOSTNAME"):
        m = re.search(r"-(\d+)$", _get(env, name, ""))
        if m:
            return int(m.group(1))
    return None


def k8s_env(env):
    """The variables ``bpslaunch --k8s`` adds for this pod's role (see the module docstring)."""
    role = _get(env, "DMLC_ROLE", "").lower()
    if role not in ("scheduler", "server", "worker"):
        raise ConfigError(f"DMLC_ROLE={env.get('DMLC_ROLE')!r}: bpslaunch --k8s needs the pod's role "
                          "(scheduler, server or worker) in DMLC_ROLE; see examples/kubernetes/")
    out = {"BYTEPS_LAUNCHER": "kubernetes"}
    pod_ip = _get(env, "POD_IP", "")
    if pod_ip and not _get(env, "DMLC_NODE_HOST"):
        out["DMLC_NODE_HOST"] = pod_ip
    if role == "scheduler" and pod_ip:
        # the others reach it by its DNS name; it binds the pod's own address
        out["DMLC_PS_ROOT_URI"] = pod_ip
    if role == "worker" and not _get(env, "DMLC_WORKER_ID"):
        index = pod_index(env)
        if index is None:
            raise ConfigError("bpslaunch --k8s: a worker pod needs JOB_COMPLETION_INDEX (indexed Job) or a "
                              "StatefulSet name ending in -N in POD_NAME to derive DMLC_WORKER_ID")
        num = _get(env, "DMLC_NUM_WORKER", "")
        if num.isdigit() and index >= int(num):
            raise ConfigError(f"worker pod index {index} >= DMLC_NUM_WORKER={num}: the Job's completions and "
                              "DMLC_NUM_WORKER disagree")
        out["DMLC_WORKER_ID"] = str(index)
    return out
