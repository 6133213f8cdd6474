"""RDMA device discovery (topology/rdma.py) on recorded descriptions, and on this machine (none).

The recorded descriptions follow the documented formats: ``ibv_devinfo -v`` (rdma-core) and the
kernel's sysfs attributes under /sys/class/infiniband (Documentation/ABI/stable/sysfs-class-infiniband).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from test_topology import _fake_sysfs  # noqa: E402

from byteps import topology  # noqa: E402
from byteps.core import _worker_core, ucx  # noqa: E402
from byteps.topology import detect, rdma  # noqa: E402

# ibv_devinfo -v of a ConnectX-5 RoCE port (trimmed: the lines discovery reads and their neighbours)
IBV_DEVINFO = """\
hca_id:\tmlx5_0
\ttransport:\t\t\tInfiniBand (0)
\tfw_ver:\t\t\t\t16.35.2000
\tnode_guid:\t\t\t0c42:a103:0065:ad9a
\tsys_image_guid:\t\t\t0c42:a103:0065:ad9a
\tvendor_id:\t\t\t0x02c9
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tmax_mtu:\t\t4096 (5)
\t\t\tactive_mtu:\t\t1024 (3)
\t\t\tport_lid:\t\t0
\t\t\tlink_layer:\t\tEthernet
\t\t\tactive_width:\t\t4X (2)
\t\t\tactive_speed:\t\t25.0 Gbps (32)
\t\t\tphys_state:\t\tLINK_UP (5)
\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:0e42:a1ff:fe65:ad9a, RoCE v1
\t\t\tGID[  1]:\t\tfe80::e42:a1ff:fe65:ad9a, RoCE v2
\t\t\tGID[  2]:\t\t0000:0000:0000:0000:0000:0000:0000:0000

hca_id:\tmlx4_0
\ttransport:\t\t\tInfiniBand (0)
\tnode_guid:\t\t\t0002:c903:0010:1234
\tphys_port_cnt:\t\t\t2
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_DOWN (1)
\t\t\tlink_layer:\t\tInfiniBand
\t\t\tactive_width:\t\t1X (1)
\t\t\tactive_speed:\t\t2.5 Gbps (1)
\t\tport:\t2
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tlink_layer:\t\tInfiniBand
\t\t\tactive_width:\t\t4X (2)
\t\t\tactive_speed:\t\t14.0 Gbps (16)
\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:0002:c903:0010:1235
"""


def test_parse_ibv_devinfo():
    devs = rdma.parse_ibv_devinfo(IBV_DEVINFO)
    assert [d.name for d in devs] == ["mlx5_0", "mlx4_0"]
    cx5, cx3 = devs
    assert cx5.node_guid == "0c42:a103:0065:ad9a" and len(cx5.ports) == 1
    p = cx5.ports[0]
    assert (p.number, p.state, p.link_layer, p.rate_gbps) == (1, "ACTIVE", "Ethernet", 100.0)  # 4 x 25
    assert p.gids == ["fe80:0000:0000:0000:0e42:a1ff:fe65:ad9a", "fe80::e42:a1ff:fe65:ad9a"]  # zero GID left out
    assert [(q.state, q.rate_gbps, q.active) for q in cx3.ports] == [("DOWN", 2.5, False), ("ACTIVE", 56.0, True)]
    assert cx3.rate_gbps == 56.0  # the active port's, not port 1's
    found = rdma.Discovery(devs, "ibv_devinfo")
    assert max(d.rate_gbps for d in found.devices) == 100.0  # the fastest machine-wide
    assert "port 1: ACTIVE, 100 Gb/s, Ethernet, GID[0] fe80:" in found.summary()


def _ib_tree(root, ports, numa="1", guid="0c42:a103:0065:ad9a"):
    dev = root / "class/infiniband/mlx5_0"
    (dev / "device").mkdir(parents=True)
    (dev / "device/numa_node").write_text(numa + "\n")
    (dev / "node_guid").write_text(guid + "\n")
    for number, (state, rate, gids) in ports.items():
        p = dev / "ports" / str(number)
        (p / "gids").mkdir(parents=True)
        (p / "state").write_text(state + "\n")
        (p / "rate").write_text(rate + "\n")
        (p / "link_layer").write_text("InfiniBand\n")
        for i, g in enumerate(gids):
            (p / "gids" / str(i)).write_text(g + "\n")
    return dev


def test_sysfs_description(tmp_path):
    _ib_tree(tmp_path, {1: ("1: DOWN", "10 Gb/sec (4X SDR)", ["0000:0000:0000:0000:0000:0000:0000:0000"]),
                        2: ("4: ACTIVE", "200 Gb/sec (4X HDR)", ["fe80:0000:0000:0000:0c42:a103:0065:ad9b"])})
    found = rdma.discover(sysfs_root=str(tmp_path / "class/infiniband"), use_pyverbs=False)
    assert found.source == "sysfs" and [d.name for d in found.devices] == ["mlx5_0"]
    d = found.devices[0]
    assert (d.numa_node, d.node_guid) == (1, "0c42:a103:0065:ad9a")
    assert [(p.number, p.state, p.rate_gbps, p.gids) for p in d.ports] == [
        (1, "DOWN", 10.0, []), (2, "ACTIVE", 200.0, ["fe80:0000:0000:0000:0c42:a103:0065:ad9b"])]
    assert d.rate_gbps == 200.0  # the active port's
    assert "mlx5_0 (NUMA node 1" in found.summary()


def test_no_device_is_reported_cleanly(tmp_path):
    found = rdma.discover(sysfs_root=str(tmp_path / "absent"), use_pyverbs=False)
    assert found.devices == []
    assert found.summary().startswith("no RDMA device (")


def test_this_machine_and_auto_transport():
    """These machines have no RDMA device: discovery says so, bpslaunch --topology prints it, and
    BYTEPS_TRANSPORT=auto keeps TCP links."""
    found = rdma.discover()
    if found.devices:
        pytest.skip(f"this machine has RDMA devices: {found.summary()}")
    assert found.summary().startswith("no RDMA device")
    assert "RDMA devices: no RDMA device" in topology.plan_text(env={})
    assert ucx.choose("auto", _worker_core) == "tcp"
    assert ucx.choose("tcp", _worker_core) == "tcp"


def test_rdma_rate_is_the_nics_bandwidth_in_placement(tmp_path):
    """A recorded machine whose RDMA NIC's port 1 is down and port 2 active at 200 Gb/s: the
    detected NIC (what placement and bpslaunch --topology use as B) has 200 Gb/s."""
    nic = "pci0000:00/0000:00:01.0/0000:05:00.0"
    _fake_sysfs(tmp_path, {"devices": {nic: {"vendor": "0x15b3", "class": "0x020700", "numa_node": "0"}},
                           "nodes": {0: "0-7"}, "net": {}})
    dev = _ib_tree(tmp_path, {1: ("1: DOWN", "56 Gb/sec (4X FDR)", []), 2: ("4: ACTIVE", "200 Gb/sec (4X HDR)", [])})
    (dev / "device/numa_node").unlink()
    (dev / "device").rmdir()
    (dev / "device").symlink_to(tmp_path / "devices" / nic)  # as the kernel links it
    m = detect.detect(root=str(tmp_path), nvlinks=[])
    assert [(n.name, n.gbps) for n in m.nics] == [("mlx5_0", 200.0)]


def test_transport_setting_errors():
    """A bad BYTEPS_TRANSPORT is a ConfigError naming it; ``ucx`` insists: a native module built
    without UCX (here _reduce, which never has it) is a RuntimeError saying why."""
    from byteps import config
    from byteps.core import _reduce
    from byteps.errors import ConfigError

    with pytest.raises(ConfigError, match="BYTEPS_TRANSPORT='rdma' must be one of auto, tcp, ucx"):
        config.load({"BYTEPS_TRANSPORT": "rdma"})
    with pytest.raises(RuntimeError, match="BYTEPS_TRANSPORT=ucx, but UCX cannot be used: byteps was built "
                                           "without UCX"):
        ucx.choose("ucx", _reduce)
