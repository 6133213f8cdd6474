"""Where a byteps job's processes go on a Ray cluster, as a pure function of the cluster's nodes
(docs/ray.md, "Placement"; the BytePS paper's §4.1).

Ray places the worker bundles; this module takes the nodes they landed on and decides the rest: a
colocated server on every worker node, standalone servers on ``k`` CPU-only nodes (by default
``min(CPU-only nodes, n)``, none for ``n = 1``), the scheduler on the first worker node. When every
node of the job reports the same address (several Ray nodes on one machine), each gets its own
127.0.0.x. No Ray import here: tests check the policy on recorded node tables."""
import dataclasses
from collections import OrderedDict

from byteps import placement

#: resources every Ray node has; any other resource a worker asks for marks the nodes that have it as
#: accelerator nodes (not CPU-only)
_PLAIN_RESOURCES = frozenset({"CPU", "memory", "object_store_memory"})


@dataclasses.dataclass(frozen=True)
class Server:
    node_id: str
    host: str
    role: str  #: "colocated" | "standalone"


@dataclasses.dataclass(frozen=True)
class Layout:
    """The processes of one job: where they run and the DMLC_* view each gets."""

    worker_nodes: tuple   #: node id per worker machine, DMLC_WORKER_ID order
    local_size: int       #: worker processes per worker machine
    cpu_nodes: tuple      #: node ids of the standalone servers' nodes
    hosts: dict           #: node id -> address the byteps processes of that node bind to and announce
    scheduler_node: str
    loopback: bool = False  #: one machine emulating several nodes: each node has its own 127.0.0.x

    def host_for(self, node):
        """The address of a node that joins the job (an elastic server's, byteps.ray.elastic): its own
        127.0.0.x on an emulated cluster, else the node's address (``node``: a ``ray.nodes()`` entry)."""
        if self.loopback:
            used = set(self.hosts.values())
            return next(f"127.0.0.{i}" for i in range(1, 255) if f"127.0.0.{i}" not in used)
        return node.get("NodeManagerAddress", "127.0.0.1")

    @property
    def servers(self):
        """Colocated servers (one per worker node) first, then the standalone ones."""
        return ([Server(n, self.hosts[n], "colocated") for n in self.worker_nodes]
                + [Server(n, self.hosts[n], "standalone") for n in self.cpu_nodes])

    @property
    def num_workers(self):
        return len(self.worker_nodes) * self.local_size

    def base_env(self, scheduler_port, job_id, secret):
        """Variables every process of the job shares."""
        return {"DMLC_NUM_WORKER": str(len(self.worker_nodes)), "DMLC_NUM_SERVER": str(len(self.servers)),
                "DMLC_PS_ROOT_URI": self.hosts[self.scheduler_node], "DMLC_PS_ROOT_PORT": str(scheduler_port),
                "BYTEPS_JOB_ID": job_id, "BYTEPS_JOB_SECRET": secret}

    def worker_env(self, rank):
        """The per-process variables of global worker rank ``rank`` (machine-major, as byteps ranks)."""
        machine, local = divmod(rank, self.local_size)
        node = self.worker_nodes[machine]
        return {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(machine), "BYTEPS_LOCAL_RANK": str(local),
                "BYTEPS_LOCAL_SIZE": str(self.local_size), "DMLC_NODE_HOST": self.hosts[node]}

    @staticmethod
    def server_env(server):
        return {"DMLC_ROLE": "server", "DMLC_NODE_HOST": server.host, "BYTEPS_SERVER_ROLE": server.role}


def accelerator_keys(worker_resources):
    """The resources a worker asks for that mark accelerator nodes (GPU, custom ones)."""
    return {k for k, v in (worker_resources or {}).items() if v and k not in _PLAIN_RESOURCES}


def useful_extra(n, available):
    """How many CPU-only nodes improve the job's step time (Eq. 6): none for one worker machine,
    at most ``n`` otherwise."""
    return 0 if n <= 1 else min(available, n)


def group_workers(node_per_worker):
    """Worker machines from the node of each worker process: ``(nodes in first-seen order, local
    size, rank order)``, where ``rank order[r]`` is the index in ``node_per_worker`` of global rank
    ``r``. Every node must hold the same number of workers (byteps needs one BYTEPS_LOCAL_SIZE)."""
    by_node = OrderedDict()
    for i, node in enumerate(node_per_worker):
        by_node.setdefault(node, []).append(i)
    sizes = {len(v) for v in by_node.values()}
    if len(sizes) != 1:
        detail = ", ".join(f"{node[:8]}: {len(v)}" for node, v in by_node.items())
        raise ValueError(f"byteps needs the same number of workers on every node, but Ray placed them "
                         f"{detail}; use a placement strategy that packs evenly (e.g. num_workers a "
                         f"multiple of workers_per_node) or STRICT_SPREAD")
    order = [i for v in by_node.values() for i in v]
    return tuple(by_node), sizes.pop(), order


def plan_layout(nodes, node_per_worker, worker_resources=None, num_cpu_servers=None):
    """The job's layout.

    Args:
        nodes: ``ray.nodes()`` (dicts with NodeID, Alive, NodeManagerAddress, Resources).
        node_per_worker: the node id of each worker process, in the order Ray placed them.
        worker_resources: what one worker asks for (selects which nodes are not CPU-only).
        num_cpu_servers: standalone servers; None = the plan's choice (:func:`useful_extra`).
            Asking for more CPU-only nodes than exist is an error naming what exists.

    Returns:
        (:class:`Layout`, rank order of :func:`group_workers`).
    """
    worker_nodes, local_size, order = group_workers(node_per_worker)
    alive = [n for n in nodes if n.get("Alive", True)]
    by_id = {n["NodeID"]: n for n in alive}
    missing = [w for w in worker_nodes if w not in by_id]
    if missing:
        raise ValueError(f"worker node(s) {', '.join(m[:8] for m in missing)} are not alive in the cluster")
    special = accelerator_keys(worker_resources)
    cpu_only = cpu_only_nodes(alive, worker_nodes, special)
    if num_cpu_servers is None:
        k = useful_extra(len(worker_nodes), len(cpu_only))
    else:
        if num_cpu_servers < 0 or num_cpu_servers > len(cpu_only):
            raise ValueError(f"num_cpu_servers={num_cpu_servers}, but the cluster has {len(cpu_only)} CPU-only "
                             f"node(s) without {sorted(special) or 'workers'}")
        k = num_cpu_servers
    cpu_nodes = tuple(n["NodeID"] for n in cpu_only[:k])
    job_nodes = list(worker_nodes) + list(cpu_nodes)
    addresses = [by_id[n].get("NodeManagerAddress", "127.0.0.1") for n in job_nodes]
    loopback = len(job_nodes) > 1 and len(set(addresses)) == 1
    if loopback:
        # one machine pretending to be several (see the module docstring): loopback has 127.0.0.0/8
        hosts = {n: f"127.0.0.{i + 1}" for i, n in enumerate(job_nodes)}
    else:
        hosts = dict(zip(job_nodes, addresses))
    layout = Layout(worker_nodes=worker_nodes, local_size=local_size, cpu_nodes=cpu_nodes, hosts=hosts,
                    scheduler_node=worker_nodes[0], loopback=loopback)
    return layout, order


def cpu_only_nodes(alive, worker_nodes, special):
    """The alive nodes a standalone server may use: no worker of the job, none of the workers' special
    resources; the ones with the most CPUs first (summation is CPU work), then a stable order."""
    cpu_only = [n for n in alive if n["NodeID"] not in worker_nodes
                and not any(n.get("Resources", {}).get(k) for k in special)]
    cpu_only.sort(key=lambda n: (-n.get("Resources", {}).get("CPU", 0), n["NodeID"]))
    return cpu_only


def expected_shares(layout):
    """Model share of each server of ``layout`` (colocated first), from Eq. 1-2."""
    cpu, gpu = placement.shares(len(layout.worker_nodes), len(layout.cpu_nodes))
    return [gpu if s.role == "colocated" else cpu for s in layout.servers]
