"""bench_users.py's training step: an MLP trained with bps.DistributedOptimizer (or DDP with
bps.ddp_comm_hook) against DDP over gloo in the same processes, and its table (see bench_users.py)."""
import sys
import time

from users_common import _f, device, spread


def make_model(torch, width, hidden, layers, seed):
    torch.manual_seed(seed)
    mods, d = [], width
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(d, hidden), torch.nn.ReLU()]
        d = hidden
    mods.append(torch.nn.Linear(d, width))
    return torch.nn.Sequential(*mods)


def train_worker(args, bps, dist, torch):
    import copy

    from torch.nn.parallel import DistributedDataParallel

    rank, size = bps.rank(), bps.size()
    dev = device(args, torch)
    model_b = make_model(torch, args.width, args.hidden, args.layers, args.seed).to(dev)
    model_d = copy.deepcopy(model_b)
    device_ids = [dev.index] if dev.type == "cuda" else None
    if args.bps_api == "ddp-hook":  # DDP whose buckets byteps averages
        net_b = DistributedDataParallel(model_b, device_ids=device_ids)
        net_b.register_comm_hook(state="bench", hook=bps.ddp_comm_hook)
        opt_b = torch.optim.SGD(net_b.parameters(), lr=args.lr)
    else:
        net_b = model_b
        opt_b = bps.DistributedOptimizer(torch.optim.SGD(model_b.parameters(), lr=args.lr),
                                         named_parameters=model_b.named_parameters())
        bps.broadcast_parameters(model_b.state_dict(), root_rank=0)
        bps.broadcast_optimizer_state(opt_b, root_rank=0)
    ddp = DistributedDataParallel(model_d, device_ids=device_ids)
    opt_d = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    warm, steps = 1, args.steps
    total = (warm + args.repeat) * steps
    data = []
    for i in range(total):  # the same batch for both systems at step i on this rank
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + i * 1009 + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        data.append((x.to(dev), torch.tanh(x.roll(1, dims=1)).to(dev)))

    def step_bps(i):
        x, y = data[i]
        opt_b.zero_grad()  # default: set_to_none=True, fresh gradients every step
        loss = torch.nn.functional.mse_loss(net_b(x), y)
        loss.backward()
        opt_b.step()
        return loss.item()

    def step_ddp(i):
        x, y = data[i]
        opt_d.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt_d.step()
        return loss.item()

    systems = [("byteps", step_bps), ("ddp", step_ddp)]
    losses = {"byteps": [], "ddp": []}
    times = {"byteps": {}, "ddp": {}}
    done = {"byteps": 0, "ddp": 0}
    for rep in range(warm + args.repeat):
        for name, fn in systems[rep % 2:] + systems[:rep % 2]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):  # loss.item() waits for the step's GPU work, as a training loop's logging does
                losses[name].append(fn(done[name]))
                done[name] += 1
            elapsed = time.perf_counter() - t0
            if rep >= warm:
                times[name][rep - warm] = elapsed
        if rank == 0:
            print(f"BENCH-PROGRESS train rep {rep}", flush=True)
    rel = [abs(a - b) / max(abs(a), abs(b), 1e-12) for a, b in zip(losses["byteps"], losses["ddp"])]
    pdiff = max(float((pb.detach() - pd.detach()).abs().max())
                for pb, pd in zip(model_b.parameters(), model_d.parameters()))
    params = sum(p.numel() for p in model_b.parameters())
    return {"times": times, "losses": losses, "loss_max_rel_diff": max(rel), "param_max_abs_diff": pdiff,
            "params": params, "param_bytes": 4 * params}


def summarize_train(layout, procs, job, args):
    ranks = job["ranks"]
    size = job["size"]
    res = {}
    for system in ("byteps", "ddp"):
        reps = sorted({int(r) for rk in ranks for r in rk["times"][system]})
        block = {r: max(rk["times"][system][str(r)] for rk in ranks) for r in reps}
        res[system] = {r: args.steps * args.batch * size / t for r, t in block.items()}
    per_rep = [res["byteps"][r] / res["ddp"][r] for r in res["byteps"] if r in res["ddp"]]
    rel = max(rk["loss_max_rel_diff"] for rk in ranks)
    pdiff = max(rk["param_max_abs_diff"] for rk in ranks)
    b, d, q = spread(list(res["byteps"].values())), spread(list(res["ddp"].values())), spread(per_rep)
    tuned = [rk.get("tuning") or {} for rk in ranks]
    if len({t.get("partition_bytes") for t in tuned}) > 1:
        raise SystemExit(f"{layout}: workers used different partition sizes: {tuned}")
    if tuned[0]:
        print(f"{layout}: {tuned[0]['text']}; credits by rank {[t['credit'] for t in tuned]}", file=sys.stderr)
    return {"partition_bytes": tuned[0].get("partition_bytes"), "partition_source": tuned[0].get("source"),
            "credits": [t.get("credit") for t in tuned], "tuning": tuned, "layout": layout, "procs": procs, "model_bytes": ranks[0]["param_bytes"], "batch": args.batch,
            "steps_per_block": args.steps, "byteps_samples_s": b[0], "byteps_min": b[1], "byteps_max": b[2],
            "ddp_samples_s": d[0], "ddp_min": d[1], "ddp_max": d[2], "ratio": q[0], "ratio_min": q[1],
            "ratio_max": q[2], "per_rep_samples_s": res, "loss_max_rel_diff": rel, "param_max_abs_diff": pdiff,
            "losses_equal": rel <= args.loss_rtol, "losses_rank0": ranks[0]["losses"]}


def train_table(rows):
    out = ["| layout | procs | model MB | batch/proc | partition (credit) | byteps samples/s [min-max] | "
           "DDP-gloo samples/s [min-max] | byteps / DDP [min-max] | loss max rel. diff | losses equal | "
           "params max abs diff |",
           "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        part = "—"
        if r.get("partition_bytes"):
            size = r["partition_bytes"]
            part = (f"{size >> 10} KiB" if size % 1024 == 0 else f"{size} B") + \
                f" {r['partition_source']} ({'/'.join(str(c) for c in sorted(set(r['credits'])))})"
        out.append(f"| {r['layout']} | {r['procs']} | {r['model_bytes'] / 1e6:.1f} | {r['batch']} | {part} | "
                   f"{_f(r['byteps_samples_s'], '.1f')} [{_f(r['byteps_min'], '.1f')}-{_f(r['byteps_max'], '.1f')}] | "
                   f"{_f(r['ddp_samples_s'], '.1f')} [{_f(r['ddp_min'], '.1f')}-{_f(r['ddp_max'], '.1f')}] | "
                   f"{_f(r['ratio'])} [{_f(r['ratio_min'])}-{_f(r['ratio_max'])}] | {r['loss_max_rel_diff']:.2e} | "
                   f"{'yes' if r['losses_equal'] else 'NO'} | {r['param_max_abs_diff']:.2e} |")
    return "\n".join(out)
