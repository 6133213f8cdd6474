"""RDMA devices of this machine: names, ports, link rates, GIDs, states and NUMA nodes.

:func:`discover` reads them through pyverbs (rdma-core's Python binding) when it is installed, else
from sysfs (``/sys/class/infiniband``); :func:`parse_ibv_devinfo` reads ``ibv_devinfo -v``'s text
(recorded descriptions, tests). A machine without RDMA gets "no RDMA device" and why, never an
error. A device's fastest active port's rate is its NIC's bandwidth in the machine model
(topology/detect.py); BYTEPS_TRANSPORT=auto picks UCX only when a device is found (core/ucx.py).
"""
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

SYSFS_ROOT = "/sys/class/infiniband"
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
# ibv_port_state (verbs.h): the names ibv_devinfo prints
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


@dataclass
class RdmaPort:
    number: int
    state: str                    # "ACTIVE", "DOWN", ...
    rate_gbps: Optional[float]    # the link's signalling rate, e.g. 100.0 for "100 Gb/sec (4X EDR)"
    link_layer: str = ""          # "InfiniBand" or "Ethernet" (RoCE)
    gids: List[str] = field(default_factory=list)  # the non-zero GIDs, table order

    @property
    def active(self):
        return self.state.upper().startswith("ACTIVE")


@dataclass
class RdmaDevice:
    name: str
    numa_node: Optional[int] = None   # None: unknown, or a machine without NUMA (sysfs says -1)
    node_guid: str = ""
    ports: List[RdmaPort] = field(default_factory=list)

    @property
    def rate_gbps(self):
        """The fastest active port's rate (Gbit/s), or None."""
        return max((p.rate_gbps for p in self.ports if p.active and p.rate_gbps), default=None)


@dataclass
class Discovery:
    devices: List[RdmaDevice]
    source: str          # "pyverbs", "sysfs" or "ibv_devinfo"
    why: str = ""        # why nothing was found

    def summary(self):
        if not self.devices:
            return f"no RDMA device ({self.why})" if self.why else "no RDMA device"
        lines = []
        for d in self.devices:
            numa = f"NUMA node {d.numa_node}" if d.numa_node is not None else "NUMA node unknown"
            lines.append(f"{d.name} ({numa}{', GUID ' + d.node_guid if d.node_guid else ''})")
            for p in d.ports:
                rate = f"{p.rate_gbps:g} Gb/s" if p.rate_gbps else "rate unknown"
                gid = f", GID[0] {p.gids[0]}" if p.gids else ""
                lines.append(f"  port {p.number}: {p.state}, {rate}, {p.link_layer or 'link layer unknown'}{gid}")
        return "\n".join(lines)


def parse_rate(text):
    """Gbit/s from a sysfs ``rate`` or ibv_devinfo's text: "100 Gb/sec (4X EDR)" -> 100.0; None if absent."""
    m = re.search(r"([\d.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else None


def read_file(path, default=""):
    """A sysfs attribute's text, stripped; ``default`` when it cannot be read (topology/detect.py too)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def parse_numa_node(text):
    """A sysfs ``numa_node``: the node, or None when unknown ("-1", absent)."""
    try:
        n = int(text)
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


def _sysfs_port(root, dev, number):
    base = os.path.join(root, dev, "ports", str(number))
    state = read_file(os.path.join(base, "state"))
    # sysfs: "4: ACTIVE"
    state = state.split(":", 1)[1].strip() if ":" in state else state
    gids = []
    gid_dir = os.path.join(base, "gids")
    if os.path.isdir(gid_dir):
        for idx in sorted(os.listdir(gid_dir), key=lambda s: int(s) if s.isdigit() else 1 << 30):
            g = read_file(os.path.join(gid_dir, idx))
            if g and g != _ZERO_GID:
                gids.append(g)
    return RdmaPort(number=number, state=state or "UNKNOWN", rate_gbps=parse_rate(read_file(os.path.join(base, "rate"))),
                    link_layer=read_file(os.path.join(base, "link_layer")), gids=gids)


def from_sysfs(root=SYSFS_ROOT):
    """The devices the kernel lists under ``root`` (an empty list when there is none)."""
    if not os.path.isdir(root):
        return []
    devices = []
    for dev in sorted(os.listdir(root)):
        ports_dir = os.path.join(root, dev, "ports")
        numbers = sorted(int(p) for p in os.listdir(ports_dir) if p.isdigit()) if os.path.isdir(ports_dir) else []
        numa = parse_numa_node(read_file(os.path.join(root, dev, "device", "numa_node")))
        devices.append(RdmaDevice(name=dev, numa_node=numa, node_guid=read_file(os.path.join(root, dev, "node_guid")),
                                  ports=[_sysfs_port(root, dev, n) for n in numbers]))
    return devices


def parse_ibv_devinfo(text):
    """The devices in the output of ``ibv_devinfo -v``: hca_id blocks, their ports, rates and GIDs.
    (ibv_devinfo prints no NUMA node; sysfs has it.)"""
    devices, dev, port, width = [], None, None, "1X"
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("hca_id:"):
            dev = RdmaDevice(name=line.split(":", 1)[1].strip())
            devices.append(dev)
            port = None
        elif dev is None:
            continue
        elif line.startswith("node_guid:"):
            dev.node_guid = line.split(":", 1)[1].strip()
        elif re.match(r"port:\s*\d+$", line):
            port, width = RdmaPort(number=int(line.split(":")[1]), state="UNKNOWN", rate_gbps=None), "1X"
            dev.ports.append(port)
        elif port is None:
            continue
        elif line.startswith("state:"):  # "state:  PORT_ACTIVE (4)"
            port.state = line.split(":", 1)[1].split("(")[0].strip().replace("PORT_", "")
        elif line.startswith("link_layer:"):
            port.link_layer = line.split(":", 1)[1].strip()
        elif line.startswith("active_width:"):
            width = line.split(":", 1)[1].split("(")[0].strip()
        elif line.startswith("active_speed:"):  # "active_speed: 25.0 Gbps (32)"
            m = re.search(r"([\d.]+)\s*Gbps", line)
            lanes = int(width.rstrip("X")) if width.rstrip("X").isdigit() else 1
            if m:
                port.rate_gbps = float(m.group(1)) * lanes
        elif re.match(r"GID\[\s*\d+\]:", line):  # "GID[  0]:  fe80:0000:...:0002, RoCE v2"
            gid = line.split("]:", 1)[1].strip().split(",")[0].strip()
            if gid and gid != _ZERO_GID:
                port.gids.append(gid)
    return devices


def from_pyverbs(sysfs_root=SYSFS_ROOT):
    """The devices libibverbs opens, through pyverbs (ImportError without it; an empty list when the
    kernel has no RDMA support: pyverbs then reports ENOSYS)."""
    import pyverbs.device as d
    from pyverbs.pyverbs_error import PyverbsError

    try:
        listed = d.get_device_list()
    except PyverbsError:  # ENOSYS / no uverbs: no RDMA here
        return []
    sysfs = {x.name: x for x in from_sysfs(sysfs_root)}
    devices = []
    for item in listed:
        name = item.name.decode() if isinstance(item.name, bytes) else str(item.name)
        on_disk = sysfs.get(name)
        dev = RdmaDevice(name=name, numa_node=on_disk.numa_node if on_disk else None)
        with d.Context(name=name) as ctx:
            attr = ctx.query_device()
            dev.node_guid = str(getattr(attr, "node_guid", ""))
            for number in range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(number)
                gids = []
                for i in range(min(getattr(pa, "gid_tbl_len", 0), 16)):
                    try:
                        g = str(ctx.query_gid(number, i))
                    except PyverbsError:
                        break
                    if g and g.replace(":", "").strip("0"):
                        gids.append(g)
                sys_port = next((p for p in on_disk.ports if p.number == number), None) if on_disk else None
                dev.ports.append(RdmaPort(number=number, state=PORT_STATES.get(int(pa.state), str(pa.state)),
                                          rate_gbps=sys_port.rate_gbps if sys_port else None,
                                          link_layer="Ethernet" if int(getattr(pa, "link_layer", 1)) == 2
                                          else "InfiniBand", gids=gids))
        devices.append(dev)
    return devices


_cached = None


def discover(sysfs_root=None, use_pyverbs=True):
    """This machine's RDMA devices (cached for the default arguments): pyverbs when it is installed,
    else sysfs. Never raises: a machine without RDMA gets ``devices == []`` and the reason."""
    global _cached
    default = sysfs_root is None and use_pyverbs
    if default and _cached is not None:
        return _cached
    root = sysfs_root or SYSFS_ROOT
    result = None
    if use_pyverbs:
        try:
            devices = from_pyverbs(root)
            result = Discovery(devices, "pyverbs", "" if devices else "libibverbs lists none (no RDMA support in "
                               "this kernel, or no RDMA NIC)")
        except ImportError:
            pass
        except Exception as e:  # a broken device must not stop start-up: sysfs next
            result = Discovery([], "pyverbs", f"pyverbs failed: {e}")
    if result is None or not result.devices:
        devices = from_sysfs(root)
        if devices or result is None:
            result = Discovery(devices, "sysfs", "" if devices else f"{root} lists none")
    if default:
        _cached = result
    return result
