"""The cost model of §4.2 (docs/topology.md, "The cost model"): the paper's formulas (Eq. 8-9, x*,
J_ca, J_ar), and :func:`traffic`, the bytes each link of a :class:`~byteps.topology.strategy.Plan`
carries in the reduce half of one push_pull, counted like Eq. 9. J is taken over the machine's
internal links, ``J_net`` also over the NICs. Bandwidths are Gbit/s, bytes are bytes, times seconds.
"""
import dataclasses
import itertools
from typing import Optional

#: bytes per second in one Gbit/s
GBPS = 1e9 / 8


# ---------------------------------------------------------------------------------------
# the paper's formulas (any consistent units)


def eq8_switch_cpu(n, x, m=1.0):
    """Eq. 8: traffic on a switch's uplink when x of the data is brute-force copied."""
    return (n * x + (1.0 - x)) * m


def eq9_gpu_switch(n, x, m=1.0):
    """Eq. 9: traffic on a GPU's link to its switch."""
    return ((2 * n - 1) / n * (1.0 - x) + x) * m


def mix_time(x, n, b_gpu, b_switch, m=1.0):
    """J(x) = max(t(N,S)/b(N,S), t(S,C)/b(S,C)) for n GPUs per switch."""
    return max(eq9_gpu_switch(n, x, m) / b_gpu, eq8_switch_cpu(n, x, m) / b_switch)


def optimal_mix(n, b_gpu, b_switch):
    """x* in [0, 1] minimising :func:`mix_time`: where its two link times meet (0 when n = 1)."""
    if n <= 1:
        return 0.0
    k = b_gpu / b_switch
    x = ((2 * n - 1) - k * n) / ((n - 1) * (1 + k * n))
    return min(1.0, max(0.0, x))


def cpu_assisted_time(n, b_gpu, b_switch, m=1.0):
    """The paper's J_ca = M / b(S,C) * max(1, (2n-1)/(kn)), k = b(N,S)/b(S,C) (equals J(0))."""
    k = b_gpu / b_switch
    return m / b_switch * max(1.0, (2 * n - 1) / (k * n))


def ring_allreduce_time(num_gpus, b_bottleneck, m=1.0):
    """The paper's J_ar = 2(N-1)M / (N b_bottleneck) for a ring over N = np GPUs."""
    return 2 * (num_gpus - 1) * m / (num_gpus * b_bottleneck)


# ---------------------------------------------------------------------------------------
# per-link traffic of a plan


@dataclasses.dataclass
class LinkLoad:
    name: str
    kind: str  #: gpu-pcie | uplink | nvlink | cross-switch | qpi | nic
    bytes: float
    gbps: float

    @property
    def seconds(self):
        return self.bytes / (self.gbps * GBPS) if self.gbps else 0.0


@dataclasses.dataclass(frozen=True)
class Mix:
    """The brute-force / CPU-assisted mix on a cpu_assisted plan (§4.2.1)."""

    n: int
    b_gpu: float
    b_switch: float
    x_star: float
    j0: float  #: J(0), CPU-assisted aggregation alone (what byteps runs)
    j_star: float  #: J(x*)


@dataclasses.dataclass(frozen=True)
class Ring:
    """Ring all-reduce over the same GPUs (the baseline of §4.2.1)."""

    order: tuple  #: GPU indices around the best ring
    b_bottleneck: float  #: Gbit/s of its slowest hop
    hop: str  #: what that hop is
    j_ar: float


@dataclasses.dataclass(frozen=True)
class Cost:
    model_bytes: float
    links: tuple  #: LinkLoad, largest time first
    j: float  #: max over the machine's internal links (the paper's J)
    bottleneck: str
    j_net: float  #: max including the NICs
    net_bottleneck: str
    mix: Optional[Mix] = None
    ring: Optional[Ring] = None
    alternatives: tuple = ()  #: (strategy, J, J_net) of the other strategies on the same GPUs


def _add(loads, name, kind, nbytes, gbps):
    if nbytes <= 0:
        return
    if name in loads:
        loads[name].bytes += nbytes
    else:
        loads[name] = LinkLoad(name, kind, float(nbytes), float(gbps))


def traffic(plan, model_bytes, x=0.0):
    """{link name: LinkLoad} for the reduce half of one push_pull of ``model_bytes`` per process."""
    m = float(model_bytes)
    loads = {}
    mach = plan.machine
    n = plan.local_size

    def nic_share(rank, nbytes):
        name = plan.rails[rank]
        if not name:
            return
        nic = next(c for c in mach.nics if c.name == name)
        _add(loads, nic.name, "nic", nbytes, nic.gbps)
        if nic.switch:  # the NIC reads host memory through its switch's uplink (principle 2)
            _add(loads, f"{nic.switch}-uplink", "uplink", nbytes, mach.switch(nic.switch).uplink_gbps)

    if plan.device == "cpu":
        p = len(plan.groups)
        qpi = [link for link in mach.links if link.kind == "qpi"]
        if p > 1 and qpi and len(set(plan.group_names)) > 1:
            # PCIE_REDUCE reads the other groups' partial sums across the socket link
            _add(loads, "qpi", "qpi", 2 * (p - 1) / p * m, min(q.gbps for q in qpi))
        for r in range(n):
            nic_share(r, m / n)
        return loads

    gpu = [mach.gpu(d) for d in plan.devices]

    def pcie(rank, nbytes):
        g = gpu[rank]
        _add(loads, f"gpu{g.index}-pcie", "gpu-pcie", nbytes, g.link_gbps)

    def uplink(rank, nbytes):
        sw = mach.switch(gpu[rank].switch)
        _add(loads, f"{sw.id}-uplink", "uplink", nbytes, sw.uplink_gbps)

    def nvlink(rank, nbytes):
        g = gpu[rank]
        _add(loads, f"gpu{g.index}-nvlink", "nvlink", nbytes, mach.nvlink_total_gbps(g.index))

    def ring_over_pcie(per_edge):
        """GPU-to-GPU traffic of a ring (or chain) over PCIe in local-rank order."""
        for r in range(n):
            pcie(r, 2 * per_edge)  # send and receive, as Eq. 9 counts them
            a, b = gpu[r], gpu[(r + 1) % n]
            if a.switch != b.switch:
                _add(loads, f"copy {a.switch}->{b.switch}", "cross-switch", per_edge, mach.cross_switch_gbps())
                uplink(r, per_edge)
                uplink((r + 1) % n, per_edge)

    if plan.strategy == "none":
        pcie(0, m)
        uplink(0, m)
        nic_share(0, m)
    elif plan.strategy == "cpu_assisted":
        for members in plan.groups:
            size = len(members)
            for r in members:
                pcie(r, eq9_gpu_switch(size, x, m))
            uplink(members[0], eq8_switch_cpu(size, x, m))
        for r in range(n):
            nic_share(r, m / n)
    elif plan.strategy == "reduce_scatter":
        if plan.nvlink:
            for r in range(n):
                nvlink(r, 2 * (n - 1) / n * m)
        else:
            ring_over_pcie((n - 1) / n * m)
        for r in range(n):
            pcie(r, m / n)
            uplink(r, m / n)
            nic_share(r, m / n)
    elif plan.strategy == "reduce_broadcast":
        if plan.nvlink:  # a chain reduce: every GPU receives and sends M
            for r in range(n):
                nvlink(r, 2 * m)
        else:
            ring_over_pcie(m)
        share = m / len(plan.roots)
        for r in plan.roots:
            pcie(r, share)
            uplink(r, share)
            nic_share(r, share)
    return loads


def best_ring(machine, devices):
    """The ring over ``devices`` whose slowest hop is fastest (exhaustive up to 9 GPUs)."""
    devices = list(devices)
    if len(devices) < 2:
        return None

    def hop(a, b):
        nv = machine.nvlink_gbps(a, b)
        if nv:
            return nv, "NVLink"
        ga, gb = machine.gpu(a), machine.gpu(b)
        if ga.switch == gb.switch:
            return min(ga.link_gbps, gb.link_gbps), "PCIe within a switch"
        return machine.cross_switch_gbps(), "GPU-to-GPU copy across PCIe switches"

    hops = {(a, b): hop(a, b) for a in devices for b in devices if a != b}

    def slowest(order):
        return min((hops[order[i], order[(i + 1) % len(order)]] for i in range(len(order))), key=lambda h: h[0])

    if len(devices) <= 9:
        first, rest = devices[0], devices[1:]
        best = max(((first,) + p for p in itertools.permutations(rest)), key=lambda o: slowest(o)[0])
    else:
        best = tuple(devices)
    return best, slowest(best)


def evaluate(plan, model_bytes, alternatives=(), ring=True):
    """The :class:`Cost` of a plan (and J of ``alternatives``: plans of other strategies)."""
    loads = traffic(plan, model_bytes)
    links = tuple(sorted(loads.values(), key=lambda ld: (-ld.seconds, ld.name)))
    internal = [ld for ld in links if ld.kind != "nic"]
    j_link = max(internal, key=lambda ld: ld.seconds, default=None)
    net_link = max(links, key=lambda ld: ld.seconds, default=None)
    mix = None
    if plan.strategy == "cpu_assisted" and plan.device == "gpu":
        n = max(len(g) for g in plan.groups)
        b_gpu = min(plan.machine.gpu(d).link_gbps for d in plan.devices) * GBPS
        b_sw = min(plan.machine.switch(plan.machine.gpu(plan.devices[g[0]]).switch).uplink_gbps
                   for g in plan.groups) * GBPS
        x_star = optimal_mix(n, b_gpu, b_sw)
        mix = Mix(n, b_gpu / GBPS, b_sw / GBPS, x_star, mix_time(0.0, n, b_gpu, b_sw, model_bytes),
                  mix_time(x_star, n, b_gpu, b_sw, model_bytes))
    ring_cost = None
    if ring and plan.device == "gpu" and len(plan.devices) > 1:
        order, (b, what) = best_ring(plan.machine, plan.devices)
        ring_cost = Ring(order, b, what, ring_allreduce_time(len(plan.devices), b * GBPS, model_bytes))
    alts = []
    for alt in alternatives:
        alt_cost = evaluate(alt, model_bytes, ring=False)
        alts.append((alt.strategy, alt_cost.j, alt_cost.j_net))
    return Cost(model_bytes=float(model_bytes), links=links, j=j_link.seconds if j_link else 0.0,
                bottleneck=j_link.name if j_link else "-", j_net=net_link.seconds if net_link else 0.0,
                net_bottleneck=net_link.name if net_link else "-", mix=mix, ring=ring_cost,
                alternatives=tuple(alts))
