"""byteps on Ray: ``RayExecutor`` (horovod.ray's API) and a Ray Train backend (``BytePSConfig``).

    import ray, byteps.ray
    ray.init(address="auto")
    ex = byteps.ray.RayExecutor(num_workers=4, use_gpu=True)   # servers placed by the k/n plan
    ex.start(); print(ex.run(train_fn)); ex.shutdown()

See docs/ray.md. Needs Ray (``pip install 'byteps[ray]'``).
"""
try:
    import ray as _ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("byteps.ray needs Ray: pip install 'byteps[ray]' (or pip install 'ray[train]')") from e

from .executor import RayExecutor
from .layout import Layout, plan_layout
from .services import BytePSRayError

__all__ = ["RayExecutor", "BytePSConfig", "BytePSRayError", "Layout", "plan_layout"]


def __getattr__(name):
    # ray.train (and its torch dependency) is imported only when the Train backend is asked for
    if name == "BytePSConfig":
        from .train import BytePSConfig
        return BytePSConfig
    raise AttributeError(f"module 'byteps.ray' has no attribute {name!r}")
