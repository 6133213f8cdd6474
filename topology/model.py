"""The machine model: GPUs, PCIe switches, NUMA nodes, NICs and NVLink/NVSwitch/QPI links.

The graph of the BytePS paper's §4.2 (Fig. 6-8); bandwidths are in Gbit/s, one direction, as the
paper quotes them. A machine comes from :func:`byteps.topology.detect.detect` or from a JSON
description (:func:`load`, :func:`from_dict`; the schema is in docs/topology.md,
``topology/fixtures/*.json`` are examples). Loading validates everything and raises
:class:`TopologyError` naming the file, the field and what is wrong.
"""
import dataclasses
import json
import os
from typing import Optional

from byteps.errors import ConfigError

#: JSON schema version written by :func:`to_dict`
VERSION = 1
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LINK_KINDS = ("nvlink", "nvswitch", "qpi")


class TopologyError(ConfigError):
    """A machine description (file, dict or override) that cannot be used, with the reason."""


@dataclasses.dataclass(frozen=True)
class Numa:
    id: int
    cpus: int = 0  #: logical CPUs on the node (0: unknown)


@dataclasses.dataclass(frozen=True)
class Switch:
    """A PCIe switch (or, when detected, a CPU root port) and its uplink to a CPU socket."""

    id: str
    numa: int
    uplink_gbps: float  #: b(S_j, C_j) in the paper


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    switch: str
    link_gbps: float  #: b(N_i, S_j): the GPU's own PCIe link to its switch
    name: str = ""
    pci: str = ""  #: PCI address (detected machines)


@dataclasses.dataclass(frozen=True)
class Nic:
    name: str
    numa: int
    gbps: float  #: line rate
    switch: Optional[str] = None  #: None: on the CPU's own PCIe lanes (paper Fig. 6(a))
    pci: str = ""


@dataclasses.dataclass(frozen=True)
class Link:
    """A non-PCIe link: ``nvlink`` gpuA-gpuB, ``nvswitch`` gpuA-fabric, ``qpi`` numaA-numaB."""

    kind: str
    a: str
    b: str
    gbps: float


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    numas: tuple
    switches: tuple
    gpus: tuple
    nics: tuple
    links: tuple = ()
    #: measured GPU-to-GPU copy bandwidth across PCIe switches (the paper's b_bottleneck, 80 Gbps on
    #: its PCIe-only box); None: the slowest uplink on the path
    cross_switch_copy_gbps: Optional[float] = None
    description: str = ""
    source: str = ""  #: where the model came from (file path, "detected", ...)

    # -- lookups ----------------------------------------------------------------------------
    def switch(self, switch_id):
        for s in self.switches:
            if s.id == switch_id:
                return s
        raise KeyError(switch_id)

    def gpu(self, index):
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)

    def nics_on(self, switch_id):
        return [n for n in self.nics if n.switch == switch_id]

    def nvlink_gbps(self, a, b):
        """Total NVLink bandwidth between GPUs a and b (direct links, or both on the NVSwitch)."""
        direct = sum(link.gbps for link in self.links if link.kind == "nvlink"
                     and {link.a, link.b} == {f"gpu{a}", f"gpu{b}"})
        if direct:
            return direct
        fabric = {link.a: link.gbps for link in self.links if link.kind == "nvswitch"}
        if f"gpu{a}" in fabric and f"gpu{b}" in fabric:
            return min(fabric[f"gpu{a}"], fabric[f"gpu{b}"])
        return 0.0

    def nvlink_total_gbps(self, index):
        """All NVLink bandwidth of one GPU (to peers and to the NVSwitch)."""
        me = f"gpu{index}"
        return sum(link.gbps for link in self.links if link.kind in ("nvlink", "nvswitch") and me in (link.a, link.b))

    def nvlink_connected(self, indices):
        """True when the GPUs in ``indices`` form one NVLink/NVSwitch-connected component."""
        indices = list(indices)
        if len(indices) <= 1:
            return True
        seen, todo = {indices[0]}, [indices[0]]
        while todo:
            a = todo.pop()
            for b in indices:
                if b not in seen and self.nvlink_gbps(a, b) > 0:
                    seen.add(b)
                    todo.append(b)
        return len(seen) == len(indices)

    def cross_switch_gbps(self):
        """b_bottleneck for a GPU-to-GPU copy between two PCIe switches."""
        if self.cross_switch_copy_gbps:
            return self.cross_switch_copy_gbps
        return min((s.uplink_gbps for s in self.switches), default=0.0)

    def summary(self):
        nv = "NVSwitch" if any(link.kind == "nvswitch" for link in self.links) else (
            "NVLink" if any(link.kind == "nvlink" for link in self.links) else "no NVLink")
        return (f"{len(self.gpus)} GPUs, {len(self.switches)} PCIe switches, {len(self.nics)} NIC(s), "
                f"{len(self.numas)} NUMA node(s), {nv}")


# ---------------------------------------------------------------------------------------
# JSON descriptions

_TOP_KEYS = {"version", "name", "description", "numa", "switches", "gpus", "nics", "links",
             "cross_switch_copy_gbps"}
_FIELDS = {
    "numa": ({"id"}, {"cpus"}),
    "switches": ({"id", "numa", "uplink_gbps"}, set()),
    "gpus": ({"index", "switch", "link_gbps"}, {"name", "pci"}),
    "nics": ({"name", "numa", "gbps"}, {"switch", "pci"}),
    "links": ({"kind", "a", "b", "gbps"}, set()),
}


def _positive(where, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TopologyError(f"{where} must be a positive number (Gbit/s), got {value!r}")
    return float(value)


def _int(where, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TopologyError(f"{where} must be an integer >= 0, got {value!r}")
    return value


def _str(where, value):
    if not isinstance(value, str) or not value:
        raise TopologyError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _entries(d, key, origin):
    items = d.get(key, [])
    if not isinstance(items, list):
        raise TopologyError(f"{origin}: '{key}' must be a list, got {type(items).__name__}")
    required, optional = _FIELDS[key]
    for i, item in enumerate(items):
        where = f"{origin}: {key}[{i}]"
        if not isinstance(item, dict):
            raise TopologyError(f"{where} must be an object, got {type(item).__name__}")
        missing = required - item.keys()
        if missing:
            raise TopologyError(f"{where} lacks {', '.join(sorted(missing))}")
        unknown = item.keys() - required - optional
        if unknown:
            raise TopologyError(f"{where} has unknown field(s) {', '.join(sorted(unknown))} "
                                f"(allowed: {', '.join(sorted(required | optional))})")
        yield where, item


def from_dict(d, origin="description"):
    """Build and validate a :class:`Machine` from a description dict; TopologyError if invalid."""
    if not isinstance(d, dict):
        raise TopologyError(f"{origin}: a machine description is a JSON object, got {type(d).__name__}")
    unknown = d.keys() - _TOP_KEYS
    if unknown:
        raise TopologyError(f"{origin}: unknown key(s) {', '.join(sorted(unknown))} "
                            f"(allowed: {', '.join(sorted(_TOP_KEYS))})")
    version = d.get("version", VERSION)
    if version != VERSION:
        raise TopologyError(f"{origin}: version {version!r} is not supported (this byteps reads version {VERSION})")
    name = _str(f"{origin}: name", d.get("name", os.path.basename(origin)))

    numas = [Numa(_int(f"{where}.id", item["id"]), _int(f"{where}.cpus", item.get("cpus", 0)))
             for where, item in _entries(d, "numa", origin)]
    if not numas:
        raise TopologyError(f"{origin}: 'numa' must list at least one NUMA node (CPU socket)")
    numa_ids = [n.id for n in numas]
    _unique(origin, "numa ids", numa_ids)

    def numa_ref(where, value):
        return _member(where, _int(where, value), numa_ids, "NUMA node")

    switches = [Switch(_str(f"{where}.id", item["id"]), numa_ref(f"{where}.numa", item["numa"]),
                       _positive(f"{where}.uplink_gbps", item["uplink_gbps"]))
                for where, item in _entries(d, "switches", origin)]
    switch_ids = [s.id for s in switches]
    _unique(origin, "switch ids", switch_ids)

    def switch_ref(where, value):
        return _member(where, _str(where, value), switch_ids, "switch")

    gpus = [Gpu(_int(f"{where}.index", item["index"]), switch_ref(f"{where}.switch", item["switch"]),
                _positive(f"{where}.link_gbps", item["link_gbps"]), str(item.get("name", "")), str(item.get("pci", "")))
            for where, item in _entries(d, "gpus", origin)]
    gpus.sort(key=lambda g: g.index)
    indices = [g.index for g in gpus]
    if indices != list(range(len(gpus))):
        raise TopologyError(f"{origin}: GPU indices must be 0..{len(gpus) - 1}, each once; got {indices}")

    nics = []
    for where, item in _entries(d, "nics", origin):
        sw = item.get("switch")
        nics.append(Nic(_str(f"{where}.name", item["name"]), numa_ref(f"{where}.numa", item["numa"]),
                        _positive(f"{where}.gbps", item["gbps"]),
                        None if sw is None else switch_ref(f"{where}.switch", sw), str(item.get("pci", ""))))
    _unique(origin, "NIC names", [n.name for n in nics])

    gpu_names, numa_names = {f"gpu{i}" for i in indices}, {f"numa{i}" for i in numa_ids}
    endpoints = {"nvlink": (gpu_names, gpu_names, "two different GPUs ('gpu0', 'gpu1', ...)"),
                 "nvswitch": (gpu_names, {"nvswitch"}, "a GPU ('gpu0', ...) and 'nvswitch'"),
                 "qpi": (numa_names, numa_names, "two different NUMA nodes ('numa0', 'numa1', ...)")}
    links = []
    for where, item in _entries(d, "links", origin):
        kind = item["kind"]
        if kind not in LINK_KINDS:
            raise TopologyError(f"{where}.kind = {kind!r} must be one of {', '.join(LINK_KINDS)}")
        a, b = _str(f"{where}.a", item["a"]), _str(f"{where}.b", item["b"])
        allowed_a, allowed_b, joins = endpoints[kind]
        if a not in allowed_a or b not in allowed_b or a == b:
            raise TopologyError(f"{where}: a {kind} link joins {joins}; got {a!r}-{b!r}")
        links.append(Link(kind, a, b, _positive(f"{where}.gbps", item["gbps"])))

    cross = d.get("cross_switch_copy_gbps")
    if cross is not None:
        cross = _positive(f"{origin}: cross_switch_copy_gbps", cross)
    return Machine(name=name, numas=tuple(numas), switches=tuple(switches), gpus=tuple(gpus), nics=tuple(nics),
                   links=tuple(links), cross_switch_copy_gbps=cross, description=str(d.get("description", "")),
                   source=origin)


def _member(where, value, have, what):
    if value not in have:
        raise TopologyError(f"{where} = {value!r} is not a {what} (have: {', '.join(map(str, have)) or 'none'})")
    return value


def _unique(origin, what, values):
    dup = sorted({v for v in values if values.count(v) > 1}, key=str)
    if dup:
        raise TopologyError(f"{origin}: duplicate {what}: {', '.join(map(str, dup))}")


def to_dict(machine):
    """The JSON description of a machine (inverse of :func:`from_dict`)."""
    d = {"version": VERSION, "name": machine.name}
    if machine.description:
        d["description"] = machine.description
    d["numa"] = [dataclasses.asdict(n) for n in machine.numas]
    d["switches"] = [dataclasses.asdict(s) for s in machine.switches]
    d["gpus"] = [{k: v for k, v in dataclasses.asdict(g).items() if v != ""} for g in machine.gpus]
    d["nics"] = [{k: v for k, v in dataclasses.asdict(n).items() if v != ""} for n in machine.nics]
    d["links"] = [dataclasses.asdict(link) for link in machine.links]
    if machine.cross_switch_copy_gbps:
        d["cross_switch_copy_gbps"] = machine.cross_switch_copy_gbps
    return d


def load(path):
    """Read a machine description file; TopologyError naming the file if it is unusable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise TopologyError(f"cannot read machine description {path}: {e.strerror}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise TopologyError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return from_dict(d, origin=path)


def save(machine, path):
    with open(path, "w") as f:
        json.dump(to_dict(machine), f, indent=2)
        f.write("\n")


def fixture_names():
    return sorted(f[:-5] for f in os.listdir(FIXTURES) if f.endswith(".json"))


def fixture(name):
    """One of the shipped example machines (``fixture_names()``), e.g. ``"pcie_only"``."""
    path = os.path.join(FIXTURES, f"{name}.json")
    if not os.path.exists(path):
        raise TopologyError(f"no machine fixture {name!r} (have: {', '.join(fixture_names())})")
    return load(path)


def synthetic(switches=1, gpus_per_switch=0, nic_switch=None, nvlink_gbps=0.0, numa_nodes=1, cpus=0,
              link_gbps=105.0, uplink_gbps=105.0, nic_gbps=100.0, name=None):
    """A regular machine for tests and what-if plans: ``switches`` switches of ``gpus_per_switch``
    GPUs spread over ``numa_nodes`` sockets, one NIC (under switch ``nic_switch``, or on CPU 0's
    lanes when None), and an NVSwitch of ``nvlink_gbps`` per GPU when that is > 0."""
    numas = tuple(Numa(i, cpus) for i in range(numa_nodes))
    sws = tuple(Switch(f"sw{i}", i * numa_nodes // max(switches, 1), uplink_gbps) for i in range(switches))
    gpus = tuple(Gpu(s * gpus_per_switch + j, f"sw{s}", link_gbps) for s in range(switches)
                 for j in range(gpus_per_switch))
    nic_numa = 0 if nic_switch is None else sws[nic_switch].numa
    nics = (Nic("nic0", nic_numa, nic_gbps, None if nic_switch is None else f"sw{nic_switch}"),)
    links = tuple(Link("nvswitch", f"gpu{g.index}", "nvswitch", nvlink_gbps) for g in gpus) if nvlink_gbps else ()
    return Machine(name=name or f"synthetic-{switches}x{gpus_per_switch}", numas=numas, switches=sws, gpus=gpus,
                   nics=nics, links=links, source="synthetic")
