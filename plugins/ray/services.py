"""The scheduler and the Summation Service servers of a byteps job, as Ray actors in a placement group.

Each service actor runs ``python -m byteps.scheduler`` or ``python -m byteps.server`` as a child
process with PR_SET_PDEATHSIG, so it dies with its actor even when Ray SIGKILLs it. The actors are
synchronous (one task at a time, on the main thread): the signal fires when the *thread* that forked
exits. :class:`ServiceGroup` is shared by :class:`byteps.ray.RayExecutor` and the Ray Train backend."""
import collections
import os
import secrets
import subprocess
import sys
import tempfile
import threading

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from byteps import config, port_file
from byteps.log import logger
from byteps.procctl import make_preexec

from .layout import Layout

#: Ray's node-id label: a bundle selecting it is placed on that node (Ray >= 2.4x sets it on every node)
NODE_ID_LABEL = "ray.io/node-id"
SCHEDULER_CPUS = 0.1  #: logical CPUs the scheduler's bundle asks for (it only routes control messages)
TAIL_LINES = 40       #: lines of a service's output kept for error messages


class BytePSRayError(RuntimeError):
    """A byteps process on the Ray cluster failed. ``actor`` names it ("worker 1", "server 2
    (standalone)", "scheduler"), ``node_id``/``node_host`` the node it ran on."""

    def __init__(self, actor, node_id, node_host, message):
        where = f" on node {node_id[:12]}" + (f" ({node_host})" if node_host else "") if node_id else ""
        super().__init__(f"{actor}{where}: {message}")
        self.actor, self.node_id, self.node_host = actor, node_id, node_host


def describe_failure(exc):
    """A short text for an exception coming out of ``ray.get`` (a task error or a dead actor)."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return f"raised {type(cause).__name__}: {cause}"
    if isinstance(exc, ray.exceptions.ActorDiedError) or isinstance(exc, ray.exceptions.RayActorError):
        return f"the actor died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return "did not answer in time"
    return f"{type(exc).__name__}: {exc}"


@ray.remote(num_cpus=0)
class ServiceActor:
    """One scheduler or server process (see the module docstring)."""

    def __init__(self):
        self.proc = None
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.reader = None

    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    def pid(self):
        return None if self.proc is None else self.proc.pid

    def _pump(self, tag):
        for line in iter(self.proc.stdout.readline, b""):
            text = line.decode(errors="replace").rstrip("\n")
            self.tail.append(text)
            print(f"[{tag}] {text}", flush=True)  # Ray forwards actor output to the driver

    def start(self, tag, module, env, port_timeout):
        """Start the service; for the scheduler (port 0) wait for its port and return it."""
        env = dict(os.environ, **env, PYTHONUNBUFFERED="1")
        path = None
        if env.get("DMLC_ROLE") == "scheduler":
            path = os.path.join(tempfile.mkdtemp(prefix="byteps-ray-"), "port")
            env["BYTEPS_SCHEDULER_PORT_FILE"] = path
        self.proc = subprocess.Popen([sys.executable, "-m", module], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=make_preexec())
        self.reader = threading.Thread(target=self._pump, args=(tag,), daemon=True)
        self.reader.start()
        if path is None:
            return None
        try:
            port = port_file.wait(path, lambda: self.proc.poll() is not None, port_timeout)
        except TimeoutError:
            raise RuntimeError(f"did not write its port within {port_timeout:g} s") from None
        if port is None:
            self.reader.join(2)
            raise RuntimeError(f"exited with code {self.proc.returncode} before listening:\n" + "\n".join(self.tail))
        return port

    def poll(self):
        """None while running, else (exit code, last lines of output)."""
        if self.proc is None or self.proc.poll() is None:
            return None
        self.reader.join(2)
        return self.proc.returncode, "\n".join(self.tail)

    def stop(self, grace=5.0):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(grace)


def wait_placement_group(pg, what, timeout):
    """Wait until Ray has reserved ``pg``; on time-out remove it and raise naming what it held."""
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(f"Ray did not place {what} within {timeout:g} s: the cluster lacks the resources "
                           f"(available: {ray.available_resources()})") from None


class ServiceGroup:
    """The scheduler and servers of one job laid out by :class:`~byteps.ray.layout.Layout`."""

    def __init__(self, layout: Layout, cpus_per_server=1.0, env=None, timeout=120.0, job_id=None):
        self.layout = layout
        self.cpus_per_server = cpus_per_server
        self.extra_env = dict(env or {})
        self.timeout = timeout
        self.job_id = job_id or f"ray-{secrets.token_hex(6)}"
        # every connection of the job proves it knows this secret (core/auth.py)
        self.secret = self.extra_env.pop("BYTEPS_JOB_SECRET", None) or secrets.token_hex(32)
        # BYTEPS_ELASTIC=1: a server that goes (its node preempted or scaled down) is the job's to survive,
        # and servers join on nodes that come (byteps.ray.elastic)
        self.elastic = config._bool(self.extra_env, "BYTEPS_ELASTIC")
        self.pg = None
        self.actors = []   #: [(tag, actor, node id)], scheduler first
        self.servers = {}  #: tag -> its Server (layout.Server)
        self._lock = threading.Lock()  # actors and servers: the elastic node watcher adds and drops servers
        self._joined = 0
        self.port = None

    # -- naming, for errors
    def host(self, node_id):
        return self.layout.hosts.get(node_id)

    def start(self):
        """Reserve the bundles (pinned to their nodes), start the scheduler, then the servers."""
        lay = self.layout
        servers = lay.servers
        nodes = [lay.scheduler_node] + [s.node_id for s in servers]
        bundles = [{"CPU": SCHEDULER_CPUS}] + [{"CPU": self.cpus_per_server} for _ in servers]
        self.pg = placement_group(bundles, bundle_label_selector=[{NODE_ID_LABEL: node} for node in nodes],
                                  name=f"{self.job_id}-services")
        wait_placement_group(self.pg, f"the byteps scheduler and {len(servers)} server(s) on nodes "
                             f"{', '.join(s.node_id[:8] for s in servers)}", self.timeout)
        tags = ["scheduler"] + [f"server {i} ({s.role})" for i, s in enumerate(servers)]
        for i, (tag, node) in enumerate(zip(tags, nodes)):
            actor = ServiceActor.options(
                num_cpus=bundles[i]["CPU"],
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote()
            self.actors.append((tag, actor, node))
        self.servers.update(zip(tags[1:], servers))
        self.restart()
        return self

    def _snapshot(self):
        with self._lock:
            return list(self.actors)

    def _server_env(self, server):
        return dict(self.extra_env, **self.layout.base_env(self.port, self.job_id, self.secret),
                    **self.layout.server_env(server))

    def restart(self):
        """Start (again) the service processes: the scheduler on a fresh port, then the servers."""
        lay = self.layout
        actors = self._snapshot()
        env = dict(self.extra_env, **lay.base_env(0, self.job_id, self.secret))
        tag, sched, node = actors[0]
        env_s = dict(env, DMLC_ROLE="scheduler", DMLC_NODE_HOST=lay.hosts[node])
        self.port = self._get(tag, node, sched.start.remote(tag, "byteps.scheduler", env_s, self.timeout))
        refs = [(tag, node, actor.start.remote(tag, "byteps.server", self._server_env(self.servers[tag]),
                                               self.timeout))
                for tag, actor, node in actors[1:]]
        for tag, node, ref in refs:
            self._get(tag, node, ref)

    def relaunch(self):
        """The job ended (every worker left and stayed idle): stop what is left and start it again."""
        for tag, actor, node in self._snapshot():
            self._get(tag, node, actor.stop.remote())
        self.restart()

    # -- elastic servers (byteps.ray.elastic): servers that join and leave the running job
    def standalone_nodes(self):
        """Nodes running a standalone server now."""
        with self._lock:
            return {s.node_id for tag, s in self.servers.items() if s.role == "standalone"}

    def add_server(self, server):
        """Start a standalone server on ``server.node_id`` that joins the running job (BYTEPS_ELASTIC=1)."""
        with self._lock:
            tag = f"server +{self._joined} ({server.role}, joined)"
            self._joined += 1
        actor = ServiceActor.options(
            num_cpus=self.cpus_per_server,
            scheduling_strategy=NodeAffinitySchedulingStrategy(server.node_id, soft=False)).remote()
        try:
            self._get(tag, server.node_id, actor.start.remote(tag, "byteps.server", self._server_env(server),
                                                              self.timeout))
        except BaseException:
            release([actor], None)
            raise
        with self._lock:
            self.layout.hosts[server.node_id] = server.host
            self.actors.append((tag, actor, server.node_id))
            self.servers[tag] = server
        return tag

    def drop_server(self, tag):
        """Forget a server that went (its node left, or its process died): the job has lost it."""
        with self._lock:
            gone = [a for t, a, _ in self.actors if t == tag]
            self.actors = [e for e in self.actors if e[0] != tag]
            self.servers.pop(tag, None)
        release(gone, None)

    def tag_of(self, node_id):
        with self._lock:
            return next((t for t, s in self.servers.items() if s.node_id == node_id), None)

    def worker_env(self, rank):
        """Everything worker ``rank`` needs in its environment to join this job."""
        return dict(self.extra_env, **self.layout.base_env(self.port, self.job_id, self.secret),
                    **self.layout.worker_env(rank))

    def _get(self, tag, node, ref, timeout=None):
        try:
            return ray.get(ref, timeout=self.timeout if timeout is None else timeout)
        except Exception as e:  # noqa: BLE001 -- every failure is reported with the actor's name
            raise BytePSRayError(tag, node, self.host(node), describe_failure(e)) from e

    def check(self, allow_clean_exit=False):
        """Raise :class:`BytePSRayError` for a service that died or exited with an error; return True when
        every service is running, False when they all ended cleanly (the job ended; see :meth:`restart`)."""
        refs = [(tag, node, actor.poll.remote()) for tag, actor, node in self._snapshot()]
        ended = 0
        for tag, node, ref in refs:
            elastic_server = self.elastic and tag in self.servers
            try:
                state = self._get(tag, node, ref)
            except BytePSRayError as e:  # its actor died (with its node, usually)
                if not elastic_server:
                    raise
                self._lost_server(tag, node, str(e))
                continue
            if state is None:
                continue
            code, tail = state
            if elastic_server and code != 0:
                self._lost_server(tag, node, tail.splitlines()[-1] if tail else f"exit code {code}")
                continue
            if code != 0 or not allow_clean_exit:
                raise BytePSRayError(tag, node, self.host(node), f"the {tag.split()[0]} process exited with code "
                                     f"{code}; its last output:\n{tail}")
            ended += 1
        return ended == 0

    def _lost_server(self, tag, node, why):
        """An elastic job's server is gone: the job survives it (docs/elastic.md) or reports why not."""
        logger.warning("%s on node %s is gone (%s); the job goes on without it", tag, node[:12], why)
        self.drop_server(tag)

    def pids(self):
        """Process ids of the running service processes (tests check that none outlives stop())."""
        return [p for _, a, _ in self._snapshot() for p in [ray.get(a.pid.remote(), timeout=self.timeout)] if p]

    def stop(self):
        """Stop the processes, kill the actors and free the bundles. Idempotent; never raises."""
        refs = []
        for _, actor, _ in self._snapshot():
            try:
                refs.append(actor.stop.remote())
            except Exception:  # noqa: BLE001 -- the actor may already be gone
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        release([a for _, a, _ in self.actors], self.pg)
        self.actors, self.pg = [], None


def release(actors, pg):
    """Kill ``actors`` and remove ``pg`` (None: none), ignoring what is already gone. Never raises:
    it runs on the way out of a failure, whose error is the one to report."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 -- already dead
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 -- already removed
            pass
