"""Ray Train integration: ``TorchTrainer(train_fn, torch_config=BytePSConfig(), scaling_config=...)`` or
``DataParallelTrainer(train_fn, backend_config=BytePSConfig(), ...)`` (docs/ray.md, "Ray Train").

On start the backend lays the byteps job out around Ray Train's workers (plugins/ray/layout.py),
starts the scheduler and servers in their own placement group and sets each worker's environment;
at shutdown the services and their placement group are removed."""
import dataclasses
import os
from typing import Optional

import ray
from ray.train.backend import Backend, BackendConfig

from .layout import plan_layout
from .services import ServiceGroup


@dataclasses.dataclass
class BytePSConfig(BackendConfig):
    """Options of the byteps backend (all optional).

    Args:
        num_cpu_servers: standalone servers on CPU-only nodes; None: the plan's choice.
        cpus_per_server: logical CPUs each server's bundle reserves.
        env_vars: extra environment for every byteps process (BYTEPS_* tuning).
        timeout_s: bound on each start-up step.
        backend: the name TorchTrainer reads from a ``torch_config`` (it picks gloo/nccl when it is
            empty); informational only, byteps sets up no torch.distributed process group.
    """

    num_cpu_servers: Optional[int] = None
    cpus_per_server: float = 1.0
    env_vars: Optional[dict] = None
    timeout_s: float = 120.0
    backend: str = "byteps"

    @property
    def backend_cls(self):
        return _BytePSBackend

    def to_dict(self):
        return dataclasses.asdict(self)


def _node_id():
    return ray.get_runtime_context().get_node_id()


def _set_env(env):
    os.environ.update(env)


class _BytePSBackend(Backend):
    def on_start(self, worker_group, backend_config: BytePSConfig):
        nodes = worker_group.execute(_node_id)
        layout, order = plan_layout(ray.nodes(), nodes, worker_group.get_resources_per_worker(),
                                    backend_config.num_cpu_servers)
        self.services = ServiceGroup(layout, backend_config.cpus_per_server, backend_config.env_vars,
                                     backend_config.timeout_s).start()
        try:
            # order[r] is the Ray Train worker that gets byteps rank r (machine-major, as byteps ranks)
            ray.get([worker_group.execute_single_async(i, _set_env, self.services.worker_env(r))
                     for r, i in enumerate(order)], timeout=backend_config.timeout_s)
        except BaseException:
            self.services.stop()
            raise

    def on_shutdown(self, worker_group, backend_config):
        services = getattr(self, "services", None)
        if services is not None:
            services.stop()
            self.services = None
