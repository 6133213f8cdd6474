"""RayExecutor: a byteps job on a Ray cluster, driven from a Python script (horovod.ray's API).

    executor = RayExecutor(num_workers=4, use_gpu=True)
    executor.start()
    results = executor.run(train_fn, args=[config])   # train_fn calls bps.init() ... bps.shutdown()
    executor.shutdown()

The workers form one placement group; the scheduler and the servers a second one pinned to the nodes
plugins/ray/layout.py chose. Any failure surfaces in the driver as :class:`BytePSRayError` naming the
actor and its node, after every actor and placement group of the job has been removed (docs/ray.md)."""
import os
import secrets
import time

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .elastic import NodeWatcher
from .layout import plan_layout
from .services import BytePSRayError, ServiceGroup, describe_failure, release, wait_placement_group

POLL_INTERVAL = 0.5  #: seconds between health checks of the services while workers run


@ray.remote
class WorkerActor:
    """One byteps worker process: runs the user's functions with the job's environment set."""

    def __init__(self):
        self.executable = None

    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    def set_env(self, env):
        os.environ.update(env)  # read by byteps' init() (byteps/config.py)

    def create(self, cls, args, kwargs):
        self.executable = cls(*args, **kwargs)

    def run(self, fn, args, kwargs):
        return fn(*args, **kwargs)

    def execute(self, fn):
        return fn(self.executable)


class RayExecutor:
    """Start a byteps job's processes as Ray actors and run functions on its workers.

    Args:
        num_workers: worker processes, placed by ``strategy`` (one bundle each). Or:
        num_hosts, num_workers_per_host: that many nodes with that many workers each (STRICT_SPREAD).
        cpus_per_worker, use_gpu, gpus_per_worker: each worker's resources (gpus_per_worker defaults
            to 1 with use_gpu).
        resources_per_worker: custom Ray resources each worker asks for, e.g. ``{"gpu_node": 1}``.
            Nodes that have any of the workers' GPU/custom resources are not used for standalone servers.
        cpus_per_server: logical CPUs each server's bundle reserves (the servers do the summation).
        num_cpu_servers: standalone servers on CPU-only nodes; None: ``min(CPU-only nodes, worker
            nodes)``, none for one worker node (layout.useful_extra).
        strategy: the workers' placement group strategy (num_workers mode).
        env_vars: extra environment for every byteps process (e.g. BYTEPS_* tuning).
        timeout_s: bound on each start-up step (placement groups, actors, the scheduler's port).
        elastic_servers: an elastic Summation Service (BYTEPS_ELASTIC=1, byteps.ray.elastic): CPU-only
            nodes that join the cluster get a standalone server that joins the running job (up to the
            plan's k); a node that goes takes its server with it and the job goes on.
        node_poll_s: how often the elastic servers' watcher looks at the cluster's nodes.
    """

    def __init__(self, num_workers=None, num_hosts=None, num_workers_per_host=1, cpus_per_worker=1.0,
                 use_gpu=False, gpus_per_worker=None, resources_per_worker=None, cpus_per_server=1.0,
                 num_cpu_servers=None, strategy="PACK", env_vars=None, timeout_s=120.0, elastic_servers=False,
                 node_poll_s=1.0):
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("give either num_workers, or num_hosts with num_workers_per_host")
        if num_hosts is not None and (num_hosts < 1 or num_workers_per_host < 1):
            raise ValueError("num_hosts and num_workers_per_host must be >= 1")
        if num_workers is not None and num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.per_worker = {"CPU": float(cpus_per_worker), **(resources_per_worker or {})}
        if use_gpu or gpus_per_worker:
            self.per_worker["GPU"] = float(gpus_per_worker or 1)
        self.num_hosts, self.per_host = num_hosts, num_workers_per_host
        self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        self.strategy = strategy
        self.cpus_per_server = cpus_per_server
        self.num_cpu_servers = num_cpu_servers
        self.env_vars = dict(env_vars or {})
        if elastic_servers:
            self.env_vars["BYTEPS_ELASTIC"] = "1"
        self.elastic_servers, self.node_poll_s = elastic_servers, node_poll_s
        self.watcher = None     #: the NodeWatcher of elastic servers
        self.timeout = timeout_s
        self.job_id = f"ray-{secrets.token_hex(6)}"
        self.workers = []       #: WorkerActor handles in byteps rank order
        self.worker_nodes = []  #: node id of each, same order
        self.services = None
        self.layout = None
        self._pg = None

    # ------------------------------------------------------------------------ life cycle

    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None):
        """Place and start every process of the job; with ``executable_cls``, create one instance of it on
        each worker (for :meth:`execute`). On failure everything started is removed before the error."""
        if not ray.is_initialized():
            raise RuntimeError("RayExecutor.start(): call ray.init() first (ray.init(address='auto') on a cluster)")
        if self.workers:
            raise RuntimeError("RayExecutor.start() was already called")
        try:
            self._start_workers()
            self.layout, order = plan_layout(ray.nodes(), self.worker_nodes, self.per_worker, self.num_cpu_servers)
            self.workers = [self.workers[i] for i in order]
            self.worker_nodes = [self.worker_nodes[i] for i in order]
            self.services = ServiceGroup(self.layout, self.cpus_per_server, self.env_vars, self.timeout,
                                         self.job_id).start()
            if self.elastic_servers:
                self.watcher = NodeWatcher(self.services, self.per_worker, self.node_poll_s).start()
            self._send_env()
            if executable_cls is not None:
                self._wait([w.create.remote(executable_cls, executable_args or [], executable_kwargs or {})
                            for w in self.workers], self.timeout)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start_workers(self):
        if self.num_hosts is not None:
            bundle = {k: v * self.per_host for k, v in self.per_worker.items()}
            bundles, strategy = [bundle] * self.num_hosts, "STRICT_SPREAD"
            index = [i // self.per_host for i in range(self.num_workers)]
        else:
            bundles, strategy = [dict(self.per_worker)] * self.num_workers, self.strategy
            index = list(range(self.num_workers))
        self._pg = placement_group(bundles, strategy=strategy, name=f"{self.job_id}-workers")
        wait_placement_group(self._pg, f"{self.num_workers} byteps workers ({self.per_worker} each, {strategy})",
                             self.timeout)
        custom = {k: v for k, v in self.per_worker.items() if k not in ("CPU", "GPU")}
        for b in index:
            self.workers.append(WorkerActor.options(
                num_cpus=self.per_worker["CPU"], num_gpus=self.per_worker.get("GPU", 0), resources=custom,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=b),
            ).remote())
        self.worker_nodes = self._wait([w.node_id.remote() for w in self.workers], self.timeout, check=False)

    def _send_env(self):
        self._wait([w.set_env.remote(self.services.worker_env(r)) for r, w in enumerate(self.workers)],
                   self.timeout, check=False)

    def shutdown(self):
        """Stop every process and remove every actor and placement group of the job. Idempotent."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        release(self.workers, self._pg)
        self.workers, self.worker_nodes, self._pg = [], [], None
        if self.services is not None:
            self.services.stop()
            self.services = None

    # ------------------------------------------------------------------------ running

    def run(self, fn, args=None, kwargs=None, timeout_s=None):
        """Call ``fn(*args, **kwargs)`` on every worker; return the results in byteps rank order.

        ``fn`` joins the job with ``bps.init()`` (the environment is set) and should end with
        ``bps.shutdown()``. ``timeout_s`` bounds the whole call (None: no bound beyond byteps' own
        BYTEPS_TIMEOUT on every operation and its lost-peer detection)."""
        return self._wait(self.run_remote(fn, args, kwargs), timeout_s)

    def run_remote(self, fn, args=None, kwargs=None):
        """Like :meth:`run`, without waiting: the ObjectRefs, in rank order."""
        self._before_call()
        return [w.run.remote(fn, list(args or []), dict(kwargs or {})) for w in self.workers]

    def execute(self, fn, timeout_s=None):
        """Call ``fn(executable)`` on every worker, with the instance :meth:`start` created there."""
        self._before_call()
        return self._wait([w.execute.remote(fn) for w in self.workers], timeout_s)

    def execute_single(self, fn, rank=0, timeout_s=None):
        """Call ``fn(executable)`` on one worker (byteps rank ``rank``)."""
        self._before_call()
        return self._wait([self.workers[rank].execute.remote(fn)], timeout_s, ranks=[rank])[0]

    def _before_call(self):
        if not self.workers:
            raise RuntimeError("RayExecutor: call start() first (or it was shut down after a failure)")
        # the scheduler ends a job whose workers all called shutdown() and then stayed idle for
        # BYTEPS_TIMEOUT (scheduler/scheduler.py); the next call gets fresh services
        if not self._guard(lambda: self.services.check(allow_clean_exit=True)):
            self._guard(self.services.relaunch)
            self._send_env()

    def _guard(self, action):
        try:
            return action()
        except BaseException:
            self.shutdown()
            raise

    def _wait(self, refs, timeout_s, ranks=None, check=True):
        """Results of ``refs`` (one per worker of ``ranks``), watching the services meanwhile; on any
        failure or time-out, shut the job down and raise :class:`BytePSRayError`."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        where = {ref: r for ref, r in zip(refs, ranks)}
        results = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_INTERVAL)
                for ref in ready:
                    try:
                        results[ref] = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 -- reported with the worker's name and node
                        raise self._worker_error(where[ref], describe_failure(e)) from e
                if pending and check:
                    self.services.check()
                if pending and deadline is not None and time.monotonic() > deadline:
                    late = ", ".join(f"worker {where[r]}" for r in pending)
                    raise self._worker_error(where[pending[0]], f"{late} did not finish within {timeout_s:g} s")
        except BaseException:
            self.shutdown()
            raise
        return [results[r] for r in refs]

    def _worker_error(self, rank, message):
        node = self.worker_nodes[rank] if rank < len(self.worker_nodes) else None
        host = self.layout.hosts.get(node) if self.layout and node else None
        return BytePSRayError(f"worker {rank}", node, host, message)

    # ------------------------------------------------------------------------ introspection

    def placement(self):
        """Where everything runs: {"workers": [node id per rank], "servers": [(node id, host, role)],
        "scheduler": node id} (the tests check it against the cluster's resources)."""
        servers = self.layout.servers if self.services is None else list(self.services.servers.values())
        return {"workers": list(self.worker_nodes), "scheduler": self.layout.scheduler_node,
                "servers": [(s.node_id, s.host, s.role) for s in servers]}
