"""Human-readable text of a plan: what ``bpslaunch --topology`` prints."""


def _bytes(n):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


def _ranks(ranks):
    return ",".join(map(str, ranks))


def describe(plan):
    m = plan.machine
    out = [f"machine: {m.name}" + (f" ({m.source})" if m.source else ""), f"  {m.summary()}"]
    if m.description:
        out.append(f"  {m.description}")
    if plan.device == "gpu":
        out.append(f"local processes: {plan.local_size} (local rank r drives GPU {_ranks(plan.devices)}[r])")
    else:
        out.append(f"local processes: {plan.local_size} (CPU analogue, no GPUs)")
    out.append(f"strategy: {plan.strategy}")
    out.append("  groups: " + " ".join(f"{nm}=[{_ranks(g)}]" for nm, g in zip(plan.group_names, plan.groups)))
    if plan.strategy == "reduce_broadcast":
        out.append(f"  roots: {_ranks(plan.roots)}")
    if any(plan.rails):
        out.append("  NIC per local rank: " + " ".join(f"{r}:{nic}" for r, nic in enumerate(plan.rails)))
    if plan.overrides:
        out.append("  overrides: " + ", ".join(f"{k}={v}" for k, v in plan.overrides))
    out.append("why:")
    out += [f"  - {r}" for r in plan.reasons]
    cost = plan.cost
    if cost is None:
        return "\n".join(out)
    out.append(f"cost for M = {_bytes(cost.model_bytes)} per process (reduce half of one push_pull; the broadcast "
               "half mirrors it; a link's two directions are counted together, as in Eq. 9):")
    out.append(f"  {'link':<22}{'traffic':>12}{'bandwidth':>14}{'time':>11}")
    for ld in cost.links:
        out.append(f"  {ld.name:<22}{_bytes(ld.bytes):>12}{ld.gbps:>9.1f} Gbps{ld.seconds:>9.4f} s")
    if cost.bottleneck == "-":
        out.append("  J: no modelled internal link carries traffic")
    else:
        out.append(f"  J = {cost.j:.4f} s (bottleneck {cost.bottleneck})")
    out.append(f"  with the NICs' line rate: J_net = {cost.j_net:.4f} s ({cost.net_bottleneck})")
    if cost.mix:
        mx = cost.mix
        out.append(f"  brute-force mix (Eq. 8-9): n = {mx.n}, b(N,S) = {mx.b_gpu:g} Gbps, "
                   f"b(S,C) = {mx.b_switch:g} Gbps: "
                   f"x* = {mx.x_star:.3f}, J(0) = {mx.j0:.4f} s, J(x*) = {mx.j_star:.4f} s, "
                   f"J(0)/J(x*) = {mx.j0 / mx.j_star:.3f} (byteps runs x = 0)")
    if cost.ring:
        rg = cost.ring
        line = (f"  ring all-reduce on the same GPUs (ring {_ranks(rg.order)}): J_ar = {rg.j_ar:.4f} s, slowest hop "
                f"{rg.b_bottleneck:g} Gbps ({rg.hop})")
        if plan.nvlink:  # the ring's J leaves out the PCIe trip to the NIC that this plan's J includes
            line += "; GPU-to-GPU traffic only (the §4.2.1 comparison is for PCIe-only machines)"
        else:
            better = (1 - cost.j / rg.j_ar) * 100
            line += "; this plan's J is " + (f"{better:.1f}% smaller" if better >= 0 else f"{-better:.1f}% larger")
        out.append(line)
    if cost.alternatives:
        out.append("  other strategies on the same GPUs: "
                   + "; ".join(f"{s} J = {j:.4f} s (J_net {jn:.4f} s)" for s, j, jn in cost.alternatives))
    return "\n".join(out)
