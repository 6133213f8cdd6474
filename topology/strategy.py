"""Choosing the intra-machine aggregation strategy by the BytePS paper's rules (§4.2.3).

A :class:`Plan` says which strategy, groups, roots and NICs a machine's local processes use, and
*why* in plain text. The rules, their table and the overrides (``BYTEPS_INTRA_STRATEGY``,
``BYTEPS_REDUCE_ROOTS``, ``BYTEPS_PCIE_SWITCH_SIZE``) are in docs/topology.md.
"""
import dataclasses
import os
from typing import Optional

from .model import Machine, TopologyError

STRATEGIES = ("none", "reduce_broadcast", "reduce_scatter", "cpu_assisted")
#: env variable -> override key
ENV_OVERRIDES = {"BYTEPS_INTRA_STRATEGY": "strategy", "BYTEPS_REDUCE_ROOTS": "roots",
                 "BYTEPS_PCIE_SWITCH_SIZE": "switch_size"}
_ENV_OF = {v: k for k, v in ENV_OVERRIDES.items()}


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one machine's local processes aggregate a tensor. Ranks are *local* ranks."""

    machine: Machine
    strategy: str  #: one of STRATEGIES
    local_size: int
    device: str  #: "gpu" (local rank r drives GPU devices[r]) or "cpu" (the CPU analogue)
    devices: tuple  #: GPU index per local rank ("gpu" plans)
    groups: tuple  #: tuples of local ranks: switch groups (NUMA groups on the CPU)
    group_names: tuple  #: the switch id / NUMA node of each group
    roots: tuple  #: reduce/broadcast roots (reduce_broadcast), local ranks
    rails: tuple  #: NIC name per local rank: where its slice (or, for roots, its partitions) leaves
    s_n: int  #: switches with local GPUs and a NIC
    s_g: int  #: switches with local GPUs only
    nvlink: bool  #: NVLink/NVSwitch joins all local GPUs
    reasons: tuple
    overrides: tuple = ()  #: (key, value) pairs that were applied
    cost: Optional[object] = None  #: byteps.topology.cost.Cost, attached by plan()

    def root_for(self, partition):
        """The root that reduces and broadcasts a partition (round-robin over the roots)."""
        return self.roots[partition % len(self.roots)]

    def describe(self):
        from .report import describe
        return describe(self)


# ---------------------------------------------------------------------------------------
# overrides


def overrides_from_env(env=None):
    """The expert overrides set in the environment, parsed and checked (TopologyError if malformed)."""
    env = os.environ if env is None else env
    found = {key: raw for name, key in ENV_OVERRIDES.items() if (raw := env.get(name, "").strip())}
    return parse_overrides(found, from_env=True)


def parse_overrides(overrides, from_env=False):
    """Validate an overrides dict: ``strategy`` (str), ``roots`` (ints or "2,3"), ``switch_size`` (int)."""
    out = {}
    for key, value in (overrides or {}).items():
        name = _ENV_OF.get(key, key) if from_env else key
        if key == "strategy":
            value = str(value).strip().lower()
            if value == "auto":
                continue
            if value not in STRATEGIES[1:]:
                raise TopologyError(f"{name}={value!r} must be auto or one of {', '.join(STRATEGIES[1:])}")
            out[key] = value
        elif key == "roots":
            if isinstance(value, str):
                parts = [p.strip() for p in value.split(",")]
                try:
                    value = tuple(int(p, 10) for p in parts)
                except ValueError:
                    bad = next(p for p in parts if not p.lstrip("-").isdigit())
                    raise TopologyError(f"{name}={overrides[key]!r}: {bad!r} is not a local rank "
                                        "(use comma-separated integers, e.g. 2,3)") from None
            value = tuple(value)
            if not value:
                raise TopologyError(f"{name} is empty; list at least one local rank, e.g. 2,3")
            if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in value):
                raise TopologyError(f"{name}={value!r}: roots are local ranks, integers >= 0")
            dup = sorted({r for r in value if value.count(r) > 1})
            if dup:
                raise TopologyError(f"{name}={overrides[key]!r} lists local rank(s) {dup} more than once")
            out[key] = value
        elif key == "switch_size":
            try:
                size = int(str(value).strip(), 10)
            except ValueError:
                raise TopologyError(f"{name}={value!r} is not an integer (GPUs or processes per PCIe switch)") from None
            if size < 1:
                raise TopologyError(f"{name}={size} must be >= 1 (GPUs or processes per PCIe switch)")
            out[key] = size
        else:
            raise TopologyError(f"unknown topology override {key!r} (known: strategy, roots, switch_size)")
    if "roots" in out and out.get("strategy", "reduce_broadcast") != "reduce_broadcast":
        raise TopologyError(f"{_ENV_OF['roots'] if from_env else 'roots'} only applies to reduce_broadcast, "
                            f"but the strategy is forced to {out['strategy']}")
    return out


# ---------------------------------------------------------------------------------------
# the rules


def _ranks(ranks):
    return ", ".join(map(str, ranks))


def _runs(n, size, what):
    """Local ranks 0..n-1 in groups of ``size`` (BYTEPS_PCIE_SWITCH_SIZE), which must divide them equally."""
    if n % size:
        raise TopologyError(f"BYTEPS_PCIE_SWITCH_SIZE={size} does not divide the {n} local {what}")
    return tuple(tuple(range(s, s + size)) for s in range(0, n, size))


def _forced(overrides):
    """The strategy an override forces (roots force reduce_broadcast), or None."""
    return "reduce_broadcast" if "roots" in overrides else overrides.get("strategy")


def choose(machine, local_size=None, devices=None, overrides=None):
    """Apply §4.2.3 to ``machine`` for ``local_size`` local processes; return a :class:`Plan`.

    ``devices``: the GPU index each local rank drives (default: CUDA_VISIBLE_DEVICES order is the
    caller's business; here the first ``local_size`` GPUs). ``overrides``: a validated dict from
    :func:`parse_overrides` / :func:`overrides_from_env`.
    """
    overrides = dict(overrides or {})
    if machine.gpus:
        if devices is None:
            devices = tuple(g.index for g in machine.gpus)[:local_size or len(machine.gpus)]
        devices = tuple(devices)
        bad = [d for d in devices if d not in {g.index for g in machine.gpus}]
        if bad:
            raise TopologyError(f"GPU(s) {bad} are not in machine {machine.name} "
                                f"(GPUs 0..{len(machine.gpus) - 1})")
        if len(set(devices)) != len(devices):
            raise TopologyError(f"each local process needs its own GPU; got devices {list(devices)}")
        if local_size is not None and local_size != len(devices):
            raise TopologyError(f"{local_size} local processes but {len(devices)} GPU(s) to drive "
                                f"({list(devices)}) on machine {machine.name}")
        return _choose_gpu(machine, devices, overrides)
    if local_size is None:
        local_size = max(1, 2 * len(machine.numas))
    return _choose_cpu(machine, local_size, overrides)


def _switch_groups(machine, devices, switch_size, reasons):
    """Local ranks grouped by PCIe switch (or in runs of switch_size when overridden)."""
    n = len(devices)
    if switch_size:
        groups = _runs(n, switch_size, "GPUs into equal switch groups")
        names = tuple(machine.gpu(devices[g[0]]).switch for g in groups)
        reasons.append(f"switch groups overridden (BYTEPS_PCIE_SWITCH_SIZE={switch_size}): "
                       + " ".join(f"[{_ranks(g)}]" for g in groups))
        return groups, names
    by_switch = {}  # in order of first appearance
    for rank, d in enumerate(devices):
        by_switch.setdefault(machine.gpu(d).switch, []).append(rank)
    return tuple(map(tuple, by_switch.values())), tuple(by_switch)


def _rails(machine, devices):
    """NIC for each local rank: one under its switch (spread over the switch's GPUs), else one
    on its socket, else any; round-robin so several NICs share the load (Fairring's rails)."""
    rails = []
    for rank, d in enumerate(devices):
        gpu = machine.gpu(d)
        under = machine.nics_on(gpu.switch)
        if under:
            peers = [r for r, dd in enumerate(devices) if machine.gpu(dd).switch == gpu.switch]
            rails.append(under[peers.index(rank) % len(under)].name)
        else:
            rails.append(_nic_near(machine, machine.switch(gpu.switch).numa, rank))
    return tuple(rails)


def _nic_near(machine, numa, rank):
    """A NIC on NUMA node ``numa`` (else any), round-robin by rank; "" on a machine without NICs."""
    near = [nic for nic in machine.nics if nic.numa == numa] or list(machine.nics)
    return near[rank % len(near)].name if near else ""


def _choose_gpu(machine, devices, overrides):
    n = len(devices)
    reasons = []
    groups, names = _switch_groups(machine, devices, overrides.get("switch_size"), reasons)
    used_switches = sorted({machine.gpu(d).switch for d in devices})
    with_nic = [s for s in used_switches if machine.nics_on(s)]
    gpu_only = [s for s in used_switches if not machine.nics_on(s)]
    s_n, s_g = len(with_nic), len(gpu_only)
    nvlink = machine.nvlink_connected(devices)
    rails = _rails(machine, devices)
    base = dict(machine=machine, local_size=n, device="gpu", devices=devices, s_n=s_n, s_g=s_g, nvlink=nvlink,
                overrides=tuple(sorted(overrides.items())))
    if n == 1:
        reasons.append("one local GPU: nothing to aggregate on this machine; it copies its tensor to "
                       "host memory and pushes it")
        return Plan(strategy="none", groups=groups, group_names=names, roots=(0,), rails=rails,
                    reasons=tuple(reasons), **base)

    nic_desc = ", ".join(f"{nic.name} ({'switch ' + nic.switch if nic.switch else 'CPU ' + str(nic.numa) + ' lanes'})"
                         for nic in machine.nics) or "none"
    reasons.append(f"NICs: {nic_desc}. S_n = {s_n} switch(es) with GPUs and a NIC"
                   f"{' (' + ', '.join(with_nic) + ')' if with_nic else ''}, S_g = {s_g} with GPUs only"
                   f"{' (' + ', '.join(gpu_only) + ')' if gpu_only else ''}")
    reasons.append("NVLink/NVSwitch joins all local GPUs" if nvlink else
                   "no NVLink joining all local GPUs: GPU-to-GPU traffic goes over PCIe")

    forced = _forced(overrides)
    if forced:
        strategy = forced
        reasons.append(f"strategy forced to {forced} by an override (BYTEPS_INTRA_STRATEGY / BYTEPS_REDUCE_ROOTS); "
                       f"the rules would choose {_rule_strategy(s_n, s_g, nvlink)}")
    else:
        strategy = _rule_strategy(s_n, s_g, nvlink)
        if s_n > 0 and s_g > 0:
            reasons.append("S_n > 0 and S_g > 0: asymmetric (§4.2.3 rule 1): reduce + broadcast, with roots "
                           "that do not compete with a NIC for its switch uplink (§4.2.2)")
            if not nvlink:
                reasons.append("warning: without NVLink the reduce crosses PCIe switches (principle 1); compare "
                               "cpu_assisted below (BYTEPS_INTRA_STRATEGY=cpu_assisted)")
        elif nvlink:
            reasons.append(f"S_n = {s_n}, S_g = {s_g}: symmetric (§4.2.3 rule 2): reduce-scatter + all-gather over "
                           "NVLink across all GPUs balances the PCIe switches; no CPU-assisted aggregation is needed")
        elif len(groups) > 1:
            reasons.append(f"S_n = {s_n}, S_g = {s_g}: symmetric (§4.2.3 rule 2) without NVLink: CPU-assisted "
                           f"aggregation (§4.2.1): reduce-scatter inside each switch, copy slices to host memory, "
                           f"the CPU sums the {len(groups)} switch groups, so no GPU-to-GPU copy crosses a switch")
        else:
            reasons.append(f"S_n = {s_n}, S_g = {s_g}: symmetric (§4.2.3 rule 2) without NVLink, all GPUs under one "
                           "switch: reduce-scatter inside it and copy the slices to host memory (CPU-assisted "
                           "aggregation with a single group: nothing for the CPU to add)")

    roots = ()
    if strategy != "cpu_assisted":
        groups, names = (tuple(range(n)),), ("all",)
    if strategy == "reduce_broadcast":
        roots = _roots(machine, devices, overrides.get("roots"), gpu_only, reasons)
    elif strategy == "reduce_scatter":
        reasons.append(f"reduce-scatter over all {n} GPUs: local rank r holds slice r of the sum, copies it to "
                       "host memory and pushes it")
    else:  # cpu_assisted
        reasons.append("groups: " + " ".join(f"{nm}=[{_ranks(g)}]" for nm, g in zip(names, groups))
                       + "; PCIE_REDUCE: local rank r sums range r of the machine's tensor across groups")
        reasons.append("brute-force copy is not used (x = 0, §4.2.1): the cost model below gives the optimal mix "
                       "x* for reference only, since brute force costs n times the CPU memory bandwidth")
    if len(machine.nics) > 1:
        used = sorted(set(rails[r] for r in (roots or range(n))))
        reasons.append(f"{len(machine.nics)} NICs: multi-NIC, traffic is sharded across {len(used)} of them, each "
                       f"{'root' if roots else 'slice'} leaving through the NIC nearest its GPU (rails: "
                       + ", ".join(f"{r}->{rails[r]}" for r in (roots or range(n))) + ")")
    return Plan(strategy=strategy, groups=groups, group_names=names, roots=roots, rails=rails,
                reasons=tuple(reasons), **base)


def _rule_strategy(s_n, s_g, nvlink):
    if s_n > 0 and s_g > 0:
        return "reduce_broadcast"
    return "reduce_scatter" if nvlink else "cpu_assisted"


def _roots(machine, devices, forced_roots, gpu_only, reasons):
    n = len(devices)
    if forced_roots:
        bad = [r for r in forced_roots if r >= n]
        if bad:
            raise TopologyError(f"BYTEPS_REDUCE_ROOTS: local rank(s) {bad} do not exist (this machine has {n} local "
                                f"processes, ranks 0..{n - 1})")
        roots = tuple(forced_roots)
        near_nic = [r for r in roots if machine.nics_on(machine.gpu(devices[r]).switch)]
        reasons.append(f"roots overridden: local rank(s) {_ranks(roots)}"
                       + (f"; warning: {_ranks(near_nic)} share a switch with a NIC" if near_nic else ""))
        return roots
    if not gpu_only:  # forced on a machine where every switch has a NIC: least NIC-loaded GPUs
        roots = tuple(range(n))
        reasons.append("every switch holds a NIC, so no root avoids one: roots = all local ranks in turn")
        return roots
    nic_numas = {nic.numa for nic in machine.nics}
    near = [s for s in gpu_only if machine.switch(s).numa in nic_numas]
    chosen = near or gpu_only
    roots = tuple(r for r, d in enumerate(devices) if machine.gpu(d).switch in chosen)
    reasons.append(f"roots = local rank(s) {_ranks(roots)} (GPUs {_ranks(devices[r] for r in roots)} on switch(es) "
                   f"{', '.join(chosen)}{', on the NIC socket' if near else ''}), partitions round-robin over "
                   "them; the sum reaches host memory through an uplink no NIC uses")
    return roots


def _choose_cpu(machine, local_size, overrides):
    """The CPU analogue: processes grouped by NUMA node (or by BYTEPS_PCIE_SWITCH_SIZE)."""
    reasons = ["no GPUs on this machine: the CPU analogue; worker processes stand in for GPUs and sum "
               "through shared memory"]
    n = local_size
    numas = [nd.id for nd in machine.numas] or [0]
    per_node = -(-n // len(numas))  # contiguous blocks, as a NUMA-pinned launcher would place them
    size = overrides.get("switch_size")
    if size:
        groups = _runs(n, size, "processes into equal groups")
        names = tuple(f"group{i}" for i in range(len(groups)))
        reasons.append(f"groups overridden (BYTEPS_PCIE_SWITCH_SIZE={size})")
    else:
        groups = tuple(tuple(range(s, min(s + per_node, n))) for s in range(0, n, per_node))
        names = tuple(f"numa{numas[i]}" for i in range(len(groups)))
        reasons.append(f"{len(numas)} NUMA node(s): processes grouped by node, so only one partial sum per node "
                       "crosses the socket interconnect")
    strategy = "none" if n == 1 else (_forced(overrides) or "cpu_assisted")
    roots = ()
    if strategy in ("reduce_broadcast", "reduce_scatter"):
        groups, names = (tuple(range(n)),), ("all",)
    if strategy == "reduce_broadcast":
        roots = overrides.get("roots") or (0,)
        bad = [r for r in roots if r >= n]
        if bad:
            raise TopologyError(f"BYTEPS_REDUCE_ROOTS: local rank(s) {bad} do not exist ({n} local processes)")
        reasons.append(f"reduce + broadcast forced: roots {_ranks(roots)}")
    elif strategy == "reduce_scatter":
        reasons.append("reduce-scatter + all-gather forced: one group of all processes")
    elif strategy == "cpu_assisted":
        reasons.append("shared-memory reduce-scatter inside each group, then the groups' copies are summed "
                       "(range r by local rank r), then copied back and gathered")
    else:
        reasons.append("one local process: nothing to aggregate")
        roots = (0,)
    rails = tuple(_nic_near(machine, numas[r // per_node], r) for r in range(n))
    return Plan(machine=machine, strategy=strategy, local_size=n, device="cpu", devices=(), groups=groups,
                group_names=names, roots=tuple(roots), rails=rails, s_n=0, s_g=0, nvlink=False,
                reasons=tuple(reasons), overrides=tuple(sorted(overrides.items())))
