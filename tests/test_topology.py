"""Topology: the paper's numbers from the cost model, the §4.2.3 rules on the fixtures, descriptions,
overrides, detection (this machine and recorded sysfs trees) and ``bpslaunch --topology``."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import byteps.topology as topology
from byteps import config
from byteps.topology import cost, detect, model, strategy
from byteps.topology.model import TopologyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_B = 13.1  # GB/s, both links of the paper's PCIe-only box (§4.2.1)


# ---------------------------------------------------------------------------------------
# the paper's numbers (§4.2.1)


def test_eq8_eq9_are_the_papers_closed_form():
    """With M = 1 GB, n = 4 the paper writes J(x) = max((3x+1)/13.1, (7-3x)/52.4)."""
    for x in np.linspace(0, 1, 11):
        paper = max((3 * x + 1) / 13.1, (7 - 3 * x) / 52.4)
        assert cost.mix_time(x, 4, PAPER_B, PAPER_B) == pytest.approx(paper, rel=1e-12)


def test_optimal_mix_is_one_fifth_and_matches_a_brute_force_search():
    x_star = cost.optimal_mix(4, PAPER_B, PAPER_B)
    assert x_star == pytest.approx(0.2, abs=1e-12)
    grid = np.linspace(0, 1, 200001)
    searched = grid[np.argmin([cost.mix_time(x, 4, PAPER_B, PAPER_B) for x in grid])]
    assert searched == pytest.approx(x_star, abs=1e-5)
    # the closed form holds for other shapes too
    for n, b_gpu, b_sw in [(2, 10, 10), (8, 13.1, 6.5), (4, 30, 10), (3, 5, 20)]:
        grid_best = grid[np.argmin([cost.mix_time(x, n, b_gpu, b_sw) for x in grid])]
        assert cost.mix_time(cost.optimal_mix(n, b_gpu, b_sw), n, b_gpu, b_sw) == pytest.approx(
            cost.mix_time(grid_best, n, b_gpu, b_sw), rel=1e-4)


def test_cpu_assisted_is_within_the_papers_ratio_of_the_optimum():
    j0 = cost.mix_time(0.0, 4, PAPER_B, PAPER_B)
    j_star = cost.mix_time(cost.optimal_mix(4, PAPER_B, PAPER_B), 4, PAPER_B, PAPER_B)
    assert j0 == pytest.approx(7 / 52.4) and j_star == pytest.approx(1.6 / 13.1)
    assert j0 / j_star == pytest.approx(0.141 / 0.129, rel=0.01)
    assert cost.cpu_assisted_time(4, PAPER_B, PAPER_B) == pytest.approx(j0)  # J_ca = J(0)


def test_cpu_assisted_beats_ring_allreduce_by_the_papers_23_7_percent():
    j_ca = cost.cpu_assisted_time(4, 105, 105)  # Gbps; k = 1
    j_ar = cost.ring_allreduce_time(2 * 4, 80)  # p = 2, n = 4, 80 Gbps across switches
    assert 1 - j_ca / j_ar == pytest.approx(0.237, abs=0.002)  # exactly 1 - 80/105 = 23.8%


def test_the_pcie_only_fixture_plan_reproduces_the_numbers():
    p = topology.plan(machine="pcie_only", model_bytes=1e9, env={})
    assert p.cost.mix.x_star == pytest.approx(0.2)
    assert p.cost.mix.j0 / p.cost.mix.j_star == pytest.approx(0.141 / 0.129, rel=0.01)
    assert p.cost.j == pytest.approx(p.cost.mix.j0)  # the plan's J is the paper's J(0)
    assert p.cost.ring.b_bottleneck == 80
    assert 1 - p.cost.j / p.cost.ring.j_ar == pytest.approx(0.237, abs=0.002)
    loads = {ld.name: ld for ld in p.cost.links}
    assert loads["gpu0-pcie"].bytes == pytest.approx(1.75e9)  # (2l-1)M/l, l = 4
    assert loads["P0-uplink"].bytes == pytest.approx(1e9)  # M per switch uplink, not 7M/4


# ---------------------------------------------------------------------------------------
# the rules on the fixtures


def test_pcie_only_box_uses_cpu_assisted_aggregation():
    p = topology.plan(machine="pcie_only", env={})
    assert (p.strategy, p.s_n, p.s_g, p.nvlink) == ("cpu_assisted", 0, 2, False)
    assert p.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    text = " ".join(p.reasons)
    assert "symmetric (§4.2.3 rule 2)" in text and "CPU-assisted" in text


def test_dgx1_box_reduces_to_roots_away_from_the_nic():
    p = topology.plan(machine="dgx1_nvlink", env={})
    assert (p.strategy, p.s_n, p.s_g, p.nvlink) == ("reduce_broadcast", 1, 3, True)
    assert p.roots == (2, 3)  # §7.3: root = 2 (or 2, 3) is optimal on this machine
    nic_switch = p.machine.nics[0].switch
    assert all(p.machine.gpu(p.devices[r]).switch != nic_switch for r in p.roots)
    assert "asymmetric (§4.2.3 rule 1)" in " ".join(p.reasons)
    # the NIC's uplink carries only the NIC's traffic, and reduce-scatter would load it more
    loads = {ld.name: ld.bytes for ld in p.cost.links}
    assert loads["P0-uplink"] == pytest.approx(1e9)
    alt = dict((s, j) for s, j, _ in p.cost.alternatives)
    assert alt["reduce_scatter"] > p.cost.j


def test_nvswitch_box_reduce_scatters_over_nvlink_and_shards_over_its_nics():
    p = topology.plan(machine="nvswitch_8nic", env={})
    assert (p.strategy, p.s_n, p.s_g, p.nvlink) == ("reduce_scatter", 4, 0, True)
    assert p.rails == tuple(f"mlx5_{k}" for k in range(8))  # rails: GPU k -> NIC k
    assert "multi-NIC" in " ".join(p.reasons)
    nic_loads = [ld.bytes for ld in p.cost.links if ld.kind == "nic"]
    assert len(nic_loads) == 8 and all(b == pytest.approx(1e9 / 8) for b in nic_loads)


def test_cpu_only_machine_groups_processes_by_numa_node():
    p = topology.plan(machine="cpu_2numa", local_size=4, env={})
    assert (p.device, p.strategy, p.groups, p.group_names) == ("cpu", "cpu_assisted", ((0, 1), (2, 3)),
                                                                ("numa0", "numa1"))
    assert "NUMA" in " ".join(p.reasons)


@pytest.mark.parametrize("name", ["pcie_only", "dgx1_nvlink", "nvswitch_8nic", "cpu_2numa"])
def test_describe_prints_strategy_reasons_and_costs(name):
    p = topology.plan(machine=name, env={})
    text = p.describe()
    assert f"strategy: {p.strategy}" in text and "why:" in text
    for reason in p.reasons:
        assert reason in text
    assert "J_net" in text
    if p.device == "gpu":
        assert "J = " in text and "ring all-reduce" in text and "other strategies" in text


@pytest.mark.parametrize("switches,per,nic_switch,nvlink", [
    (2, 4, None, 0), (2, 4, 0, 0), (4, 2, 0, 1000), (4, 2, None, 1000), (1, 8, 0, 0), (1, 8, None, 1000),
    (3, 2, 1, 0), (2, 1, None, 0)])
def test_rules_on_synthetic_machines(switches, per, nic_switch, nvlink):
    m = model.synthetic(switches, per, nic_switch=nic_switch, nvlink_gbps=nvlink, numa_nodes=2)
    p = topology.plan(machine=m, env={})
    s_n = 1 if nic_switch is not None else 0
    s_g = switches - s_n
    assert (p.s_n, p.s_g) == (s_n, s_g)
    if s_n and s_g:
        assert p.strategy == "reduce_broadcast"
        assert all(m.gpu(r).switch != f"sw{nic_switch}" for r in p.roots)
    elif nvlink:
        assert p.strategy == "reduce_scatter" and p.groups == (tuple(range(switches * per)),)
    else:
        assert p.strategy == "cpu_assisted" and len(p.groups) == switches


def test_devices_subset_and_local_size():
    p = topology.plan(machine="pcie_only", devices=(4, 5, 6, 7), env={})
    assert p.devices == (4, 5, 6, 7) and p.groups == ((0, 1, 2, 3),) and p.local_size == 4
    assert topology.plan(machine="pcie_only", local_size=1, env={}).strategy == "none"
    with pytest.raises(TopologyError, match=r"GPU\(s\) \[9\] are not in machine"):
        topology.plan(machine="pcie_only", devices=(0, 9), env={})
    with pytest.raises(TopologyError, match="its own GPU"):
        topology.plan(machine="pcie_only", devices=(1, 1), env={})


# ---------------------------------------------------------------------------------------
# descriptions


def test_fixtures_round_trip(tmp_path):
    assert set(model.fixture_names()) >= {"pcie_only", "dgx1_nvlink", "nvswitch_8nic", "cpu_2numa"}
    for name in model.fixture_names():
        m = model.fixture(name)
        path = tmp_path / f"{name}.json"
        model.save(m, path)
        again = model.load(path)
        assert model.to_dict(again) == model.to_dict(m)


def _desc(**changes):
    d = model.to_dict(model.fixture("pcie_only"))
    d.update(changes)
    return d


@pytest.mark.parametrize("changes,message", [
    ({"colour": "red"}, r"unknown key\(s\) colour"),
    ({"version": 2}, "version 2 is not supported"),
    ({"numa": []}, "at least one NUMA node"),
    ({"gpus": [{"index": 0, "switch": "P9", "link_gbps": 105}]},
     r"gpus\[0\].switch = 'P9' is not a switch \(have: P0, P1\)"),
    ({"gpus": [{"index": 0, "switch": "P0"}]}, r"gpus\[0\] lacks link_gbps"),
    ({"gpus": [{"index": 0, "switch": "P0", "link_gbps": -1}]}, r"gpus\[0\].link_gbps must be a positive number"),
    ({"gpus": [{"index": 1, "switch": "P0", "link_gbps": 1}]}, r"GPU indices must be 0..0"),
    ({"gpus": [{"index": 0, "switch": "P0", "link_gbps": 1, "speed": 3}]}, r"unknown field\(s\) speed"),
    ({"switches": [{"id": "P0", "numa": 0, "uplink_gbps": 1}] * 2}, "duplicate switch ids: P0"),
    ({"switches": [{"id": "P0", "numa": 5, "uplink_gbps": 1}]}, r"switches\[0\].numa = 5 is not a NUMA node"),
    ({"nics": [{"name": "a", "numa": 0, "gbps": 1, "switch": "X"}]}, r"nics\[0\].switch = 'X' is not a switch"),
    ({"links": [{"kind": "pcie", "a": "gpu0", "b": "gpu1", "gbps": 1}]}, "must be one of nvlink, nvswitch, qpi"),
    ({"links": [{"kind": "nvlink", "a": "gpu0", "b": "gpu0", "gbps": 1}]}, "a nvlink link joins two different GPUs"),
    ({"links": [{"kind": "nvswitch", "a": "gpu0", "b": "gpu1", "gbps": 1}]}, "a GPU .* and 'nvswitch'"),
    ({"gpus": "many"}, "'gpus' must be a list"),
])
def test_description_errors_name_the_field(changes, message):
    with pytest.raises(TopologyError, match=message):
        model.from_dict(_desc(**changes), origin="box.json")


def test_description_file_errors(tmp_path):
    with pytest.raises(TopologyError, match="cannot read machine description .*missing.json"):
        model.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",\n  "numa": [}\n')
    with pytest.raises(TopologyError, match=r"bad.json: not valid JSON \(line 2"):
        model.load(bad)
    with pytest.raises(TopologyError, match="no machine fixture 'nope'"):
        model.fixture("nope")
    with pytest.raises(TopologyError, match="a JSON object"):
        model.from_dict([1, 2])


# ---------------------------------------------------------------------------------------
# overrides


def test_env_overrides_are_validated_with_the_variable_named():
    cases = [
        ({"BYTEPS_INTRA_STRATEGY": "ring"}, "BYTEPS_INTRA_STRATEGY='ring' must be auto or one of"),
        ({"BYTEPS_REDUCE_ROOTS": "2,x"}, "BYTEPS_REDUCE_ROOTS='2,x': 'x' is not a local rank"),
        ({"BYTEPS_REDUCE_ROOTS": "2,2"}, r"lists local rank\(s\) \[2\] more than once"),
        ({"BYTEPS_REDUCE_ROOTS": "-1"}, "integers >= 0"),
        ({"BYTEPS_PCIE_SWITCH_SIZE": "four"}, "BYTEPS_PCIE_SWITCH_SIZE='four' is not an integer"),
        ({"BYTEPS_PCIE_SWITCH_SIZE": "0"}, "BYTEPS_PCIE_SWITCH_SIZE=0 must be >= 1"),
        ({"BYTEPS_REDUCE_ROOTS": "1", "BYTEPS_INTRA_STRATEGY": "cpu_assisted"},
         "only applies to reduce_broadcast, but the strategy is forced to cpu_assisted"),
    ]
    for env, message in cases:
        with pytest.raises(TopologyError, match=message):
            topology.plan(machine="pcie_only", env=env)
    with pytest.raises(TopologyError, match="BYTEPS_PCIE_SWITCH_SIZE=3 does not divide the 8 local GPUs"):
        topology.plan(machine="pcie_only", env={"BYTEPS_PCIE_SWITCH_SIZE": "3"})
    with pytest.raises(TopologyError, match=r"local rank\(s\) \[8\] do not exist .* ranks 0..7"):
        topology.plan(machine="pcie_only", env={"BYTEPS_REDUCE_ROOTS": "0,8"})
    with pytest.raises(TopologyError, match="BYTEPS_TOPOLOGY_FILE='/nonexistent.json': no such file"):
        topology.plan(env={"BYTEPS_TOPOLOGY_FILE": "/nonexistent.json"})
    with pytest.raises(TopologyError, match="unknown topology override 'colour'"):
        topology.plan(machine="pcie_only", overrides={"colour": 1}, env={})


def test_overrides_take_effect_and_are_explained(tmp_path):
    p = topology.plan(machine="dgx1_nvlink", env={"BYTEPS_REDUCE_ROOTS": "0"})
    assert p.roots == (0,) and "share a switch with a NIC" in " ".join(p.reasons)
    p = topology.plan(machine="pcie_only", env={"BYTEPS_PCIE_SWITCH_SIZE": "2"})
    assert p.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    p = topology.plan(machine="pcie_only", env={"BYTEPS_INTRA_STRATEGY": "reduce_scatter"})
    assert p.strategy == "reduce_scatter" and "the rules would choose cpu_assisted" in " ".join(p.reasons)
    # explicit overrides win over the environment, "auto" included
    env = {"BYTEPS_INTRA_STRATEGY": "reduce_scatter", "BYTEPS_REDUCE_ROOTS": ""}
    assert topology.plan(machine="pcie_only", overrides={"strategy": "auto"}, env=env).strategy == "cpu_assisted"
    # forced reduce + broadcast: roots on the GPU-only switch of the NIC's socket (P0, CPU 0)
    assert topology.plan(machine="pcie_only", overrides={"strategy": "reduce_broadcast"}, env=env).roots == (
        0, 1, 2, 3)
    assert topology.plan(machine="dgx1_nvlink", overrides={"strategy": "auto"},
                         env={"BYTEPS_REDUCE_ROOTS": "0"}).roots == (2, 3)
    path = tmp_path / "m.json"
    model.save(model.fixture("dgx1_nvlink"), path)
    assert topology.plan(env={"BYTEPS_TOPOLOGY_FILE": str(path)}).strategy == "reduce_broadcast"


def test_override_variables_are_registered_and_documented():
    doc = open(os.path.join(ROOT, "docs", "env.md")).read()
    for name in ["BYTEPS_TOPOLOGY_FILE", *strategy.ENV_OVERRIDES]:
        assert name in config.VARIABLES
        assert f"`{name}`" in doc


# ---------------------------------------------------------------------------------------
# detection


def test_detect_this_machine():
    m = detect.detect()
    nodes = [d for d in os.listdir("/sys/devices/system/node") if d.startswith("node") and d[4:].isdigit()]
    assert len(m.numas) == max(1, len(nodes))
    assert sum(n.cpus for n in m.numas) >= 1
    pci_nics = []
    for cls in ("net", "infiniband"):
        base = f"/sys/class/{cls}"
        for name in os.listdir(base) if os.path.isdir(base) else []:
            dev = os.path.join(base, name, "device")
            if os.path.exists(dev) and any(detect._BDF.match(c) for c in os.path.realpath(dev).split("/")):
                pci_nics.append(name)
    pci_nics.sort()
    assert sorted(n.name for n in m.nics) == pci_nics
    assert "lo" not in {n.name for n in m.nics}
    assert len(m.gpus) == len(detect.pci_gpus())
    p = topology.plan(env={})
    if not m.gpus:
        assert p.device == "cpu" and p.strategy in ("cpu_assisted", "none")
    assert p.describe().startswith(f"machine: {m.name} (detected)")


def _fake_sysfs(root, tree):
    """Build a sysfs-like tree: {pci path: {file: text}}, nodes, and class/net links."""
    for path, files in tree["devices"].items():
        d = root / "devices" / path
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text)
        bdf = path.rsplit("/", 1)[-1]
        link = root / "bus/pci/devices" / bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(d)
    for nid, cpus in tree["nodes"].items():
        n = root / f"devices/system/node/node{nid}"
        n.mkdir(parents=True)
        (n / "cpulist").write_text(cpus)
    for name, (path, speed) in tree["net"].items():
        c = root / "class/net" / name
        c.mkdir(parents=True)
        (c / "device").symlink_to(root / "devices" / path)
        (c / "speed").write_text(str(speed))


def test_detect_a_recorded_dgx1_like_tree(tmp_path):
    gpu = {"vendor": "0x10de", "class": "0x030200", "max_link_speed": "8.0 GT/s PCIe", "max_link_width": "16"}
    port = {"vendor": "0x8086", "class": "0x060400", "max_link_speed": "8.0 GT/s PCIe", "max_link_width": "16"}
    dev = {}
    for s in range(4):  # root port -> switch up -> switch down -> 2 GPUs, sockets 0, 0, 1, 1
        rp = f"pci0000:{s * 0x40:02x}/0000:{s * 0x40:02x}:01.0"
        dev[rp] = port
        for g in range(2):
            up, down, dev_bus = s * 0x40 + 1, s * 0x40 + 2, s * 0x40 + 3 + g
            path = f"{rp}/0000:{up:02x}:00.0/0000:{down:02x}:{g:02x}.0/0000:{dev_bus:02x}:00.0"
            dev[path] = dict(gpu, numa_node=str(s // 2))
    nic = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0"
    dev[nic] = {"vendor": "0x15b3", "class": "0x020000", "numa_node": "0"}
    dev["pci0000:00/0000:00:03.0"] = {"vendor": "0x1af4", "class": "0x020000", "numa_node": "-1"}
    _fake_sysfs(tmp_path, {"devices": dev, "nodes": {0: "0-19,40-59", 1: "20-39,60-79"},
                           "net": {"ib0": (nic, 100000), "eth0": ("pci0000:00/0000:00:03.0", -1)}})
    (tmp_path / "class/net/lo").mkdir(parents=True)  # virtual: no device link
    m = detect.detect(root=str(tmp_path), nvlinks=[])
    assert [n.cpus for n in m.numas] == [40, 40]
    assert len(m.gpus) == 8 and len(m.switches) == 4
    assert [sum(g.switch == s.id for g in m.gpus) for s in m.switches] == [2, 2, 2, 2]
    assert [s.numa for s in m.switches] == [0, 0, 1, 1]
    assert m.gpus[0].link_gbps == pytest.approx(8 * 16 * 128 / 130)
    nics = {n.name: n for n in m.nics}
    assert set(nics) == {"ib0", "eth0"}
    assert nics["ib0"].switch == m.gpus[0].switch and nics["ib0"].gbps == 100
    assert nics["eth0"].switch is None and nics["eth0"].gbps == detect.DEFAULT_NIC_GBPS
    p = topology.plan(machine=m, env={})
    assert (p.s_n, p.s_g) == (1, 3)
    assert p.strategy == "reduce_broadcast" and p.roots == (2, 3)  # the paper's choice, from sysfs alone
    # and with the DGX-1's NVLinks as nvidia-smi reports them
    links = detect.nvlinks_from_matrix(detect.parse_topo_matrix(TOPO_M))
    assert len(links) == 16 and {(link.a, link.b) for link in links} >= {("gpu0", "gpu3"), ("gpu3", "gpu7")}
    m2 = detect.detect(root=str(tmp_path), nvlinks=links)
    assert m2.nvlink_connected(range(8)) and m2.nvlink_gbps(0, 3) == 400


TOPO_M = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tmlx5_0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV1\tNV1\tNV2\tNV2\tSYS\tSYS\tSYS\tPIX\t0-19,40-59\t0
GPU1\tNV1\t X \tNV2\tNV1\tSYS\tNV2\tSYS\tSYS\tPIX\t0-19,40-59\t0
GPU2\tNV1\tNV2\t X \tNV2\tSYS\tSYS\tNV1\tSYS\tPHB\t0-19,40-59\t0
GPU3\tNV2\tNV1\tNV2\t X \tSYS\tSYS\tSYS\tNV1\tPHB\t0-19,40-59\t0
GPU4\tNV2\tSYS\tSYS\tSYS\t X \tNV1\tNV1\tNV2\tSYS\t20-39,60-79\t1
GPU5\tSYS\tNV2\tSYS\tSYS\tNV1\t X \tNV2\tNV1\tSYS\t20-39,60-79\t1
GPU6\tSYS\tSYS\tNV1\tSYS\tNV1\tNV2\t X \tNV2\tSYS\t20-39,60-79\t1
GPU7\tSYS\tSYS\tSYS\tNV1\tNV2\tNV1\tNV2\t X \tSYS\t20-39,60-79\t1
mlx5_0\tPIX\tPIX\tPHB\tPHB\tSYS\tSYS\tSYS\tSYS\t X \t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_parse_topo_matrix():
    rel = detect.parse_topo_matrix(TOPO_M)
    assert rel[(0, 3)] == "NV2" and rel[(3, 0)] == "NV2" and rel[(0, 5)] == "SYS"
    assert (0, 0) not in rel and len(rel) == 56


def test_small_parsers():
    assert detect.parse_cpulist("0-3,8,10-11") == 7
    assert detect.pcie_gbps("16.0 GT/s PCIe", "16") == pytest.approx(16 * 16 * 128 / 130)
    assert detect.pcie_gbps("2.5 GT/s", "8") == pytest.approx(16)
    assert detect.pcie_gbps("Unknown", "16") is None and detect.pcie_gbps("8 GT/s", "x") is None


# ---------------------------------------------------------------------------------------
# bpslaunch --topology


def _bpslaunch(*args, env=None):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("BYTEPS_", "DMLC_"))}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "byteps.launcher", *args], capture_output=True, text=True,
                          timeout=60, env=full, cwd=ROOT)


def test_bpslaunch_topology_prints_the_plan(tmp_path):
    out = _bpslaunch("--topology", "pcie_only")
    assert out.returncode == 0, out.stderr
    for text in ["strategy: cpu_assisted", "why:", "symmetric (§4.2.3 rule 2)", "gpu0-pcie", "P0-uplink",
                 "x* = 0.200", "J(0)/J(x*) = 1.094", "J_ar = 0.1750 s", "23.8% smaller"]:
        assert text in out.stdout, (text, out.stdout)
    path = tmp_path / "box.json"
    model.save(model.fixture("dgx1_nvlink"), path)
    out = _bpslaunch("--topology", str(path), "--local-size", "8")
    assert out.returncode == 0 and "strategy: reduce_broadcast" in out.stdout and "roots: 2,3" in out.stdout
    out = _bpslaunch("--topology", env={"BYTEPS_TOPOLOGY_FILE": str(path)})
    assert out.returncode == 0 and "strategy: reduce_broadcast" in out.stdout


def test_bpslaunch_topology_on_this_machine_and_errors(tmp_path):
    out = _bpslaunch("--topology")
    assert out.returncode == 0, out.stderr
    assert "(detected)" in out.stdout and "strategy:" in out.stdout
    out = _bpslaunch("--topology", "no-such-machine")
    assert out.returncode == 2 and "no such machine description file or fixture" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_desc(colour="red")))
    out = _bpslaunch("--topology", str(bad))
    assert out.returncode == 2 and "unknown key(s) colour" in out.stderr
    out = _bpslaunch("--topology", "pcie_only", env={"BYTEPS_REDUCE_ROOTS": "x"})
    assert out.returncode == 2 and "BYTEPS_REDUCE_ROOTS" in out.stderr
