"""bench_users.py's push_pull tables: rows, byteps / gloo ratios and latency against round trips from
a job's ranks, and their markdown (see bench_users.py for what each column means)."""
import statistics

from users_common import SIZES, _f, spread


def summarize_collectives(layout, procs, job):
    """Rows of the results (one per size/pattern/impl/names), ratios and latency, from a job's ranks."""
    ranks = job["ranks"]
    rtt = ranks[0].get("rtt", {})
    zrtt = ranks[0].get("zmq_rtt", {})
    fresh = job.get("fresh_rtt", {})
    keys = list(ranks[0]["blocks"])
    rows = {}
    for key in keys:
        label, pattern, impl, names = key.split("|")
        reps = sorted({int(r) for rk in ranks for r in rk["blocks"].get(key, {})})
        rep_medians, extra = {}, {}
        for r in reps:
            per_rank = [rk["blocks"][key][str(r)] for rk in ranks if str(r) in rk["blocks"].get(key, {})]
            rep_medians[r] = max(s["median_s"] for s in per_rank)  # the slowest rank
            for field in ("worker_faults_per_call", "worker_rss_growth_per_call"):
                vals = [s[field] for s in per_rank if field in s]
                if vals:
                    extra.setdefault(field, []).append(max(vals))
            cpu = [s["worker_cpu_per_call"] for s in per_rank if "worker_cpu_per_call" in s]
            if len(cpu) == len(per_rank):  # every worker's CPU, all ranks together
                extra.setdefault("workers_cpu_per_call", []).append(sum(cpu))
            for field in ("server_faults_per_call", "server_rss_growth_per_call", "server_rss", "server_cpu_per_call"):
                vals = [s[field] for s in per_rank if field in s]
                if vals:
                    extra.setdefault(field, []).append(vals[0])
        med, lo, hi = spread(list(rep_medians.values()))
        row = {"layout": layout, "procs": procs, "size": label, "bytes": SIZES[label], "pattern": pattern,
               "impl": impl, "names": names or None, "rep_medians_s": rep_medians, "median_s": med,
               "min_s": lo, "max_s": hi, "reps": len(rep_medians),
               "goodput_GBps": SIZES[label] / med / 1e9 if med else None}
        for field, vals in extra.items():
            row[field] = statistics.median(vals)
        if field_max := extra.get("server_rss"):
            row["server_rss_max"] = max(field_max)
        rows[(label, pattern, impl, names)] = row
    ratios, latency = [], []
    for (label, pattern, impl, names), row in rows.items():
        if impl != "byteps":
            continue
        gloo = rows.get((label, pattern, "gloo", ""))
        if gloo is None:
            continue
        per_rep = [gloo["rep_medians_s"][r] / row["rep_medians_s"][r] for r in row["rep_medians_s"]
                   if r in gloo["rep_medians_s"]]
        med, lo, hi = spread(per_rep)
        ratios.append({"layout": layout, "procs": procs, "size": label, "pattern": pattern, "names": names,
                       "ratio": med, "ratio_min": lo, "ratio_max": hi, "reps": len(per_rep),
                       "byteps_s": row["median_s"], "gloo_s": gloo["median_s"]})
        if label in rtt and pattern != "batched":
            entry = {"layout": layout, "procs": procs, "size": label, "pattern": pattern, "names": names,
                     "byteps_s": row["median_s"], "gloo_s": gloo["median_s"], "rtt_s": rtt[label],
                     "zmq_rtt_s": zrtt.get(label), "fresh_rtt_s": fresh.get(label),
                     "byteps_over_fresh_rtt": row["median_s"] / fresh[label] if label in fresh else None,
                     "byteps_over_rtt": row["median_s"] / rtt[label] if row["median_s"] else None,
                     "gloo_over_rtt": gloo["median_s"] / rtt[label]}
            beside = rows.get((label, pattern, "rtt", ""))
            if beside is not None:  # per repetition: byteps' block over the round-trip block beside it
                paired = [row["rep_medians_s"][r] / beside["rep_medians_s"][r] for r in row["rep_medians_s"]
                          if r in beside["rep_medians_s"]]
                if paired:
                    med, lo, hi = spread(paired)
                    entry.update(rtt_beside_s=beside["median_s"], byteps_over_rtt_beside=med,
                                 byteps_over_rtt_beside_min=lo, byteps_over_rtt_beside_max=hi)
            latency.append(entry)
    return list(rows.values()), ratios, latency


def _ms(x):
    return "—" if x is None else f"{x * 1e3:.3f}"


def _us(x):
    return "—" if x is None else f"{x * 1e6:.0f}"


def cpu_per_gb(b, g):
    """CPU seconds per GB of tensor reduced: byteps' workers (all ranks), its servers (all), gloo's workers."""
    def per_gb(row, field):
        v = row.get(field)
        return "—" if v is None else f"{v / (row['bytes'] / 1e9):.2f}"
    return f"{per_gb(b, 'workers_cpu_per_call')}, {per_gb(b, 'server_cpu_per_call')}; {per_gb(g, 'workers_cpu_per_call')}"


def collectives_tables(rows, ratios, latency):
    by = {(r["layout"], r["procs"], r["size"], r["pattern"], r["impl"], r["names"] or ""): r for r in rows}
    out = ["| layout | procs | size | pattern | byteps names | byteps ms [min-max] | gloo ms [min-max] | "
           "byteps GB/s | gloo GB/s | byteps / gloo [min-max] | reps | worker faults/call | server faults/call | "
           "MB kept per call (workers, servers) | CPU s per GB: byteps workers, servers; gloo |",
           "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for q in ratios:
        b = by[(q["layout"], q["procs"], q["size"], q["pattern"], "byteps", q["names"])]
        g = by[(q["layout"], q["procs"], q["size"], q["pattern"], "gloo", "")]
        kept = "—"
        if "worker_rss_growth_per_call" in b:
            kept = (f"{b['worker_rss_growth_per_call'] / 2**20:.1f}, "
                    f"{b.get('server_rss_growth_per_call', 0) / 2**20:.1f}")
        pat = "batched async" if q["pattern"] == "batched" else q["pattern"]
        out.append(f"| {q['layout']} | {q['procs']} | {q['size']} | {pat} | {q['names']} | "
                   f"{_ms(b['median_s'])} [{_ms(b['min_s'])}-{_ms(b['max_s'])}] | "
                   f"{_ms(g['median_s'])} [{_ms(g['min_s'])}-{_ms(g['max_s'])}] | "
                   f"{_f(b['goodput_GBps'], '.3f')} | {_f(g['goodput_GBps'], '.3f')} | "
                   f"{_f(q['ratio'])} [{_f(q['ratio_min'])}-{_f(q['ratio_max'])}] | {q['reps']} | "
                   f"{_f(b.get('worker_faults_per_call'), '.0f')} | {_f(b.get('server_faults_per_call'), '.0f')} | "
                   f"{kept} | {cpu_per_gb(b, g)} |")
    lat = ["| layout | procs | size | pattern | byteps names | byteps us | gloo us | raw TCP RTT us | ZeroMQ RTT us | "
           "byteps / RTT | gloo / RTT | RTT beside us | byteps / RTT beside [min-max] | fresh-process RTT us | "
           "byteps / fresh RTT |",
           "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for q in latency:
        beside = "—"
        if q.get("byteps_over_rtt_beside") is not None:
            beside = (f"{_f(q['byteps_over_rtt_beside'])} [{_f(q['byteps_over_rtt_beside_min'])}-"
                      f"{_f(q['byteps_over_rtt_beside_max'])}]")
        lat.append(f"| {q['layout']} | {q['procs']} | {q['size']} | {q['pattern']} | {q['names']} | "
                   f"{_us(q['byteps_s'])} | {_us(q['gloo_s'])} | {_us(q['rtt_s'])} | {_us(q.get('zmq_rtt_s'))} | "
                   f"{_f(q['byteps_over_rtt'])} | {_f(q['gloo_over_rtt'])} | {_us(q.get('rtt_beside_s'))} | "
                   f"{beside} | {_us(q.get('fresh_rtt_s'))} | {_f(q.get('byteps_over_fresh_rtt'))} |")
    return "\n".join(out), "\n".join(lat)


NOTES = """\
Notes: synchronous calls (each waits for its result), sums (average=False) unless --average, medians over repetitions of
the slowest rank's per-block median, [min-max] = spread of the repetitions' medians. byteps / gloo = gloo
time / byteps time per repetition (> 1: byteps faster). gloo `outofplace` is `out = t.clone();
dist.all_reduce(out)` (gloo has no out-of-place all_reduce; the clone is timed). `fresh` allocates and
fills a new tensor before each timed call. byteps names `auto` = no name= argument (as scripts call it;
byteps picks the names); `fixed` = one name= per size and pattern. `batched async` = 20 operations started, then
all awaited (gloo async_op=True), time per operation. Faults/MB kept: byteps blocks only (workers:
slowest rank; servers: total). CPU s per GB: CPU seconds (every thread, user + system) per GB of tensor,
over the timed calls: workers summed over ranks (byteps' threads and gloo's included), servers summed
over the job's servers. Latency: "byteps / RTT" = byteps' median over the round trip measured before
and after the collectives; "byteps / RTT beside" = per repetition, byteps' block over the raw round-trip block
taken in turn with it on the same connection, median [min-max]; "fresh-process RTT" = the same size's round
trip between two fresh processes bound to no CPU (bench/raw_exchange.py --clients 1, started by the driver
before and after the job, mean of the two; between the hosts of ranks 0 and 1 in the hosts layout): the round
trip a user would measure."""
