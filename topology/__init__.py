"""Machine topology: the model of a machine, its detection, the §4.2.3 strategy and its cost.

:func:`plan` is the entry point; ``bpslaunch --topology [FILE]`` prints its result. A plan names the
owners of a machine's local reduce and the roots of its NCCL stages (core/local.py).
docs/topology.md explains the design and the modules.
"""
import dataclasses
import os

from .model import Machine, TopologyError, fixture, fixture_names, from_dict, load
from .strategy import STRATEGIES, Plan, choose, overrides_from_env, parse_overrides

__all__ = ["plan", "plan_text", "Machine", "Plan", "TopologyError", "STRATEGIES", "fixture", "fixture_names", "load",
           "from_dict", "resolve_machine"]


def resolve_machine(machine=None, description=None, env=None):
    """The machine to plan for: ``machine`` (a Machine or a fixture name), else ``description`` (a
    path or dict), else the file in BYTEPS_TOPOLOGY_FILE, else the detected local machine."""
    env = os.environ if env is None else env
    if isinstance(machine, Machine):
        return machine
    if isinstance(machine, str):
        return fixture(machine)
    if machine is not None:
        raise TopologyError(f"machine must be a Machine or a fixture name, got {type(machine).__name__}")
    if isinstance(description, dict):
        return from_dict(description)
    if description is not None:
        return load(os.fspath(description))
    path = env.get("BYTEPS_TOPOLOGY_FILE", "").strip()
    if path:
        if not os.path.exists(path):
            raise TopologyError(f"BYTEPS_TOPOLOGY_FILE={path!r}: no such file (a machine description, "
                                "see docs/topology.md)")
        return load(path)
    from .detect import detect
    return detect()


def _visible_devices(machine, env):
    """GPU indices from CUDA_VISIBLE_DEVICES (numeric form) on the detected machine, else None."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None or machine.source != "detected":
        return None
    ids = [p.strip() for p in raw.split(",") if p.strip()]
    if not all(p.isdigit() for p in ids):
        return None  # UUIDs/MIG names: assume all GPUs in order
    return tuple(int(p) for p in ids if int(p) < len(machine.gpus))


def plan(machine=None, description=None, model_bytes=1e9, overrides=None, local_size=None, devices=None,
         env=None):
    """Choose how this machine's local processes aggregate tensors, and price it.

    Args:
        machine: a :class:`Machine`, or the name of a shipped fixture (``fixture_names()``:
            ``pcie_only``, ``dgx1_nvlink``, ``nvswitch_8nic``, ``cpu_2numa``).
        description: a machine description file path (JSON, docs/topology.md) or dict, used
            when ``machine`` is None. With neither, ``BYTEPS_TOPOLOGY_FILE`` is read, else the
            local machine is detected (:func:`byteps.topology.detect.detect`).
        model_bytes: bytes each process aggregates per iteration (M in the paper), for the cost.
        overrides: expert overrides, ``{"strategy": ..., "roots": (2, 3), "switch_size": 4}``;
            they take precedence over ``BYTEPS_INTRA_STRATEGY``, ``BYTEPS_REDUCE_ROOTS`` and
            ``BYTEPS_PCIE_SWITCH_SIZE`` from ``env``.
        local_size: local worker processes (default: one per GPU used; on a machine without
            GPUs two per NUMA node).
        devices: GPU index of each local rank (default: CUDA_VISIBLE_DEVICES on the detected
            machine, else GPUs 0..local_size-1).
        env: environment mapping to read (default ``os.environ``).

    Returns:
        Plan: strategy, groups, roots, NIC per rank, the reasons (``plan.reasons``), and
        ``plan.cost`` (per-link traffic, J, the brute-force mix x*, ring all-reduce J_ar and the
        other strategies' J). ``plan.describe()`` is the text ``bpslaunch --topology`` prints.

    Raises:
        TopologyError: an unusable description or override, naming the variable or field.
    """
    from .cost import evaluate

    env = os.environ if env is None else env
    mach = resolve_machine(machine, description, env)
    merged = overrides_from_env(env)
    explicit = parse_overrides(overrides)
    if "strategy" in (overrides or {}) and "roots" not in explicit:
        # an explicit strategy ("auto" included) replaces the environment's strategy and roots
        merged.pop("strategy", None)
        merged.pop("roots", None)
    merged.update(explicit)
    if devices is None:
        devices = _visible_devices(mach, env)
        if devices is not None and local_size is not None:
            devices = devices[:local_size]
    chosen = choose(mach, local_size=local_size, devices=devices, overrides=merged)
    alternatives = []
    if chosen.device == "gpu" and chosen.local_size > 1:
        base = {k: v for k, v in merged.items() if k not in ("strategy", "roots")}
        for name in STRATEGIES[1:]:
            if name != chosen.strategy:
                alternatives.append(choose(mach, devices=chosen.devices, overrides={**base, "strategy": name}))
    return dataclasses.replace(chosen, cost=evaluate(chosen, model_bytes, alternatives))


def plan_text(target=None, local_size=None, model_bytes=1e9, env=None):
    """What ``bpslaunch --topology [target]`` prints: ``target`` is a description file, a fixture
    name, or None for BYTEPS_TOPOLOGY_FILE / the detected machine."""
    if target and not os.path.exists(target):
        if target not in fixture_names():
            raise TopologyError(f"{target}: no such machine description file or fixture "
                                f"(fixtures: {', '.join(fixture_names())})")
        return plan(machine=target, local_size=local_size, model_bytes=model_bytes, env=env).describe()
    text = plan(description=target or None, local_size=local_size, model_bytes=model_bytes, env=env).describe()
    if target or (env if env is not None else os.environ).get("BYTEPS_TOPOLOGY_FILE", "").strip():
        return text
    from .rdma import discover  # the live machine: its RDMA devices too (docs/ucx.md)
    return text + "\nRDMA devices: " + discover().summary().replace("\n", "\n  ")
