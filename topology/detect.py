"""Detect the local machine's topology: sysfs for the PCI tree, NUMA nodes and NICs; NVML or
``nvidia-smi topo -m`` for NVLinks (docs/topology.md, "Detection").

GPUs are grouped by the PCIe root port they sit under (the uplink every GPU below it shares).
Every source is optional: a machine without GPUs (such as CI) is detected as a CPU-only machine
with its real NUMA nodes and NICs. Parsers take the sysfs root and command output as arguments so
they are tested on recorded trees and text.
"""
import contextlib
import glob
import os
import re
import subprocess

from .model import Gpu, Link, Machine, Nic, Numa, Switch
from .rdma import discover as discover_rdma, parse_numa_node, parse_rate, read_file as _read

SYSFS = "/sys"
NVIDIA = "0x10de"
_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$")
DEFAULT_NIC_GBPS = 100.0
DEFAULT_PCIE_GBPS = 105.0  #: the paper's measured PCIe 3.0 x16 throughput, when sysfs has no link speed
NVLINK_GBPS = {1: 160.0}  #: per link, per direction, by NVLink version; 200 for 2 and later


def parse_cpulist(text):
    """'0-3,8,10-11' -> 7 CPUs."""
    count = 0
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        count += (int(hi) - int(lo) + 1) if hi else 1
    return count


def pcie_gbps(speed, width):
    """Gbit/s of a PCIe link from sysfs 'max_link_speed' ('8.0 GT/s PCIe') and 'max_link_width'."""
    m = re.match(r"([\d.]+)\s*GT/s", speed or "")
    try:
        lanes = int(width)
    except (TypeError, ValueError):
        return None
    if not m or lanes <= 0:
        return None
    gts = float(m.group(1))
    return gts * lanes * (128 / 130 if gts >= 8 else 0.8)


def numa_nodes(root=SYSFS):
    nodes = [Numa(int(os.path.basename(path)[4:]), parse_cpulist(_read(os.path.join(path, "cpulist"))))
             for path in glob.glob(os.path.join(root, "devices/system/node/node[0-9]*"))]
    return sorted(nodes, key=lambda n: n.id) or [Numa(0, os.cpu_count() or 0)]


def _root_port(root, bdf):
    """The PCI address of the root port a device sits under (the device itself when on none)."""
    real = os.path.realpath(os.path.join(root, "bus/pci/devices", bdf))
    return next((p for p in real.split(os.sep) if _BDF.match(p)), bdf)


def _numa_of(root, bdf, valid):
    node = parse_numa_node(_read(os.path.join(root, "bus/pci/devices", bdf, "numa_node")))
    return node if node in valid else min(valid)


def _link_gbps(root, bdf):
    dev = os.path.join(root, "bus/pci/devices", bdf)
    return pcie_gbps(_read(os.path.join(dev, "max_link_speed")), _read(os.path.join(dev, "max_link_width")))


def pci_gpus(root=SYSFS):
    """PCI addresses of NVIDIA GPUs, in address order."""
    found = []
    for dev in glob.glob(os.path.join(root, "bus/pci/devices/*")):
        cls = _read(os.path.join(dev, "class"))
        if _read(os.path.join(dev, "vendor")) == NVIDIA and (cls.startswith("0x0300") or cls.startswith("0x0302")):
            found.append(os.path.basename(dev))
    return sorted(found)


def pci_nics(root=SYSFS):
    """(name, PCI address, Gbit/s or None) of every NIC that is a PCI device (virtual ones are skipped)."""
    nics = {}
    for cls in ("net", "infiniband"):
        for path in sorted(glob.glob(os.path.join(root, "class", cls, "*"))):
            dev = os.path.join(path, "device")
            if not os.path.exists(dev):
                continue  # lo, bridges, veth, ifb: no device
            chain = [p for p in os.path.realpath(dev).split(os.sep) if _BDF.match(p)]
            if not chain:
                continue
            bdf = chain[-1]
            speed = None
            try:
                mbps = int(_read(os.path.join(path, "speed"), "-1"))
                speed = mbps / 1000 if mbps > 0 else None
            except ValueError:
                pass
            if cls == "infiniband":  # rate from the first port: "100 Gb/sec (4X EDR)"
                speed = parse_rate(_read(os.path.join(path, "ports/1/rate"))) or speed
                if any(v[0] == bdf for v in nics.values()):
                    continue  # the RDMA device of a netdev already listed
            nics[os.path.basename(path)] = (bdf, speed)
    return [(name, bdf, speed) for name, (bdf, speed) in nics.items()]


def parse_topo_matrix(text):
    """Parse ``nvidia-smi topo -m``: {(i, j): relation} between GPU indices, e.g. 'NV2', 'PIX', 'SYS'."""
    header, rel = None, {}
    for ln in text.splitlines():
        cells = ln.split()
        if header is None:
            if cells and cells[0].startswith("GPU"):
                header = [c for c in cells if re.match(r"^(GPU\d+|NIC\d+|mlx\S+)$", c)]
        elif ln.startswith("Legend"):
            break
        elif cells and re.match(r"GPU\d+$", cells[0]):
            i = int(cells[0][3:])
            for col, val in zip(header, cells[1:]):
                if col.startswith("GPU") and int(col[3:]) != i:
                    rel[(i, int(col[3:]))] = val
    return rel


def nvlinks_from_matrix(rel, gbps_per_link=200.0):
    """NVLink Links from a parsed topo matrix (each pair once, NV# = # bonded links)."""
    links = []
    for (i, j), val in sorted(rel.items()):
        m = re.match(r"^NV(\d+)$", val)
        if m and i < j:
            links.append(Link("nvlink", f"gpu{i}", f"gpu{j}", int(m.group(1)) * gbps_per_link))
    return links


def _nvml_links(gpu_bdfs):
    """NVLinks through NVML (nvidia-ml-py), or None if it is unavailable."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # not installed, or no driver
        return None
    try:
        norm = {b.lower()[-12:]: i for i, b in enumerate(gpu_bdfs)}  # 'dd:bb:dd.f' tail, any domain width
        count = {}
        fabric = {}
        for idx in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(idx)
            me = norm.get(_bus_id(pynvml.nvmlDeviceGetPciInfo(h)))
            if me is None:
                continue
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if not pynvml.nvmlDeviceGetNvLinkState(h, link):
                        continue
                    remote = _bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
                    try:
                        version = pynvml.nvmlDeviceGetNvLinkVersion(h, link)
                    except Exception:
                        version = 2
                except pynvml.NVMLError:
                    break
                gbps = NVLINK_GBPS.get(version, 200.0)
                peer = norm.get(remote)
                if peer is None:  # an NVSwitch (or a bridge): the fabric
                    fabric[me] = fabric.get(me, 0.0) + gbps
                elif me < peer:
                    count[(me, peer)] = count.get((me, peer), 0.0) + gbps
        links = [Link("nvlink", f"gpu{a}", f"gpu{b}", g) for (a, b), g in sorted(count.items())]
        links += [Link("nvswitch", f"gpu{a}", "nvswitch", g) for a, g in sorted(fabric.items())]
        return links
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _bus_id(pci_info):
    bus = pci_info.busId
    if isinstance(bus, bytes):
        bus = bus.decode()
    return bus.lower()[-12:]


def _smi_links():
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):  # no nvidia-smi, or a hung driver
        return None
    return nvlinks_from_matrix(parse_topo_matrix(out.stdout)) if out.returncode == 0 else None


def detect(root=SYSFS, nvlinks=None):
    """The local machine as a :class:`Machine` (source "detected").

    ``root``: the sysfs mount (tests pass a recorded tree). ``nvlinks``: NVLink list to use
    instead of asking NVML / nvidia-smi (tests).
    """
    numas = numa_nodes(root)
    valid = {n.id for n in numas}
    gpu_bdfs = pci_gpus(root)
    switches, gpus = {}, []
    for i, bdf in enumerate(gpu_bdfs):
        port = _root_port(root, bdf)
        numa = _numa_of(root, bdf, valid)
        if port not in switches:
            up = _link_gbps(root, port) if port != bdf else None
            switches[port] = Switch(port, numa, up or DEFAULT_PCIE_GBPS)
        gpus.append(Gpu(i, port, _link_gbps(root, bdf) or DEFAULT_PCIE_GBPS, "NVIDIA GPU", bdf))
    nics = []
    # an RDMA device's fastest active port (topology/rdma.py) is its bandwidth B; pyverbs only for
    # the live machine, a recorded tree is read as files
    rdma_rates = {d.name: d.rate_gbps for d in discover_rdma(sysfs_root=os.path.join(root, "class", "infiniband"),
                                                        use_pyverbs=root == SYSFS).devices if d.rate_gbps}
    for name, bdf, speed in pci_nics(root):
        speed = rdma_rates.get(name, speed)
        port = _root_port(root, bdf)
        nics.append(Nic(name, _numa_of(root, bdf, valid), speed or DEFAULT_NIC_GBPS,
                        port if port in switches else None, bdf))
    links = []
    if gpus:
        found = nvlinks if nvlinks is not None else _nvml_links(gpu_bdfs)
        if found is None:
            found = _smi_links() or []
        links += found
    nodes = sorted(valid)
    for a, b in zip(nodes, nodes[1:]):
        links.append(Link("qpi", f"numa{a}", f"numa{b}", 300.0))  # the paper's "> 300 Gbps"
    return Machine(name=os.uname().nodename, numas=tuple(numas), switches=tuple(switches.values()),
                   gpus=tuple(gpus), nics=tuple(nics), links=tuple(links),
                   description="detected from sysfs" + (" and NVML/nvidia-smi" if gpus else ""), source="detected")
