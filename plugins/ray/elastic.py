"""An elastic Summation Service on a Ray cluster: standalone servers follow the CPU-only nodes
(``RayExecutor(elastic_servers=True)``, BYTEPS_ELASTIC=1; docs/ray.md, "Spot CPU servers").

A CPU-only node that joins gets a standalone server that joins the running job, while k is below the
plan's; a node that goes takes its server with it and the job goes on without it."""
import threading

import ray

from byteps.log import logger

from . import layout as layouts


class NodeWatcher:
    """Starts and forgets standalone servers as CPU-only nodes come and go (a thread of the driver)."""

    def __init__(self, services, worker_resources, poll_s=1.0):
        self.services = services
        self.special = layouts.accelerator_keys(worker_resources)
        self.poll_s = poll_s
        self.events = []  #: ("joined" | "left", node id, server tag), in order: for logs and tests
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="byteps-ray-nodes", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.services.timeout)

    def _run(self):
        while not self._stop.wait(self.poll_s):
            try:
                self.step(ray.nodes())
            except Exception as e:  # noqa: BLE001 -- a failed start is retried at the next poll
                logger.warning("byteps.ray: could not follow the cluster's nodes: %s", e)

    def step(self, nodes):
        """One look at the cluster (``ray.nodes()``): forget servers whose node left, start servers on
        CPU-only nodes that joined while k is below the plan's."""
        lay = self.services.layout
        alive = [n for n in nodes if n.get("Alive", True)]
        alive_ids = {n["NodeID"] for n in alive}
        serving = self.services.standalone_nodes()
        for node in serving - alive_ids:
            tag = self.services.tag_of(node)
            if tag is not None:
                logger.warning("byteps.ray: node %s left the cluster; the job goes on without %s", node[:12], tag)
                self.services.drop_server(tag)
                self.events.append(("left", node, tag))
        serving &= alive_ids
        free = [n for n in layouts.cpu_only_nodes(alive, lay.worker_nodes, self.special) if n["NodeID"] not in serving]
        room = layouts.useful_extra(len(lay.worker_nodes), len(serving) + len(free)) - len(serving)
        for node in free[:max(room, 0)]:
            server = layouts.Server(node["NodeID"], lay.host_for(node), "standalone")
            tag = self.services.add_server(server)
            logger.warning("byteps.ray: CPU-only node %s joined the cluster: %s on %s joins the job", server.node_id[:12],
                           tag, server.host)
            self.events.append(("joined", server.node_id, tag))
