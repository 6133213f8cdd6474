"""Read a job timeline (trace.py's file) back and say where the time went.

``python -m byteps.timeline PATH`` prints :func:`text` of :func:`summarize`; ``--png`` draws
:func:`chart`. Everything here works on the merged, clock-aligned spans; times are microseconds.
"""
import collections
import json
import statistics

from .spans import SERVER_STAGES


class Trace:
    """The spans of a trace file: ``spans`` (dicts with pid, tid, name, ts, dur, end, args),
    ``processes`` (pid -> name), ``steps`` (worker pid -> [(step, ts, end)]) and ``nodes`` (otherData)."""

    def __init__(self, doc):
        self.processes, self.threads, self.spans, self.steps = {}, {}, [], collections.defaultdict(list)
        for e in doc.get("traceEvents", ()):
            if e.get("ph") == "M" and e.get("name") == "process_name":
                self.processes[e["pid"]] = e["args"]["name"]
            elif e.get("ph") == "M" and e.get("name") == "thread_name":
                self.threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
            elif e.get("ph") == "X" and e.get("cat") == "step":
                self.steps[e["pid"]].append((e["args"]["step"], e["ts"], e["ts"] + e["dur"]))
            elif e.get("ph") == "X" and e.get("cat") == "byteps":
                self.spans.append(dict(e, end=e["ts"] + e["dur"]))
        self.nodes = doc.get("otherData", {}).get("byteps", {}).get("nodes", {})

    def role(self, pid):
        return self.processes.get(pid, "").split(" ")[0]

    def worker_rank(self, pid):
        return int(self.processes[pid].split(" ")[1])

    def server_spans(self):
        return [s for s in self.spans if s["name"] in SERVER_STAGES]

    def worker_spans(self):
        return [s for s in self.spans if s["name"] not in SERVER_STAGES]


def load(path):
    with open(path) as f:
        return Trace(json.load(f))


def union(intervals):
    """Total length covered by [(start, end)] (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def _part(s):
    a = s["args"]
    return (a["tensor"], a["partition"], a["round"])


def pairs(trace):
    """[(worker PUSH span, the server's RECV span of that push)], matched by tensor, partition, round,
    server and pushing rank."""
    recv = {}
    for s in trace.spans:
        if s["name"] == "RECV":
            recv[_part(s) + (s["args"]["server"], s["args"].get("rank"))] = s
    out = []
    for s in trace.spans:
        if s["name"] == "PUSH" and trace.role(s["pid"]) == "worker":
            r = recv.get(_part(s) + (s["args"]["server"], trace.worker_rank(s["pid"])))
            if r is not None:
                out.append((s, r))
    return out


def _stats(durs):
    durs = sorted(durs)
    return {"count": len(durs), "total_ms": sum(durs) / 1e3, "mean_us": statistics.fmean(durs) if durs else 0.0,
            "p50_us": durs[len(durs) // 2] if durs else 0.0, "max_us": durs[-1] if durs else 0.0}


def _steps(trace):
    """{step: (start, end)} over all workers: a step ends when its slowest worker marks it."""
    out = {}
    for marks in trace.steps.values():
        for step, ts, end in marks:
            s, e = out.get(step, (ts, end))
            out[step] = (min(s, ts), max(e, end))
    return out


def critical_path(trace, start, end):
    """The chain of the partition that finished last in [start, end]: its worker spans and the spans of
    its round on its server, in time order."""
    done = [s for s in trace.worker_spans() if s["name"] in ("PULL", "LOCAL_BROADCAST") and start <= s["end"] <= end]
    if not done:
        return []
    last = max(done, key=lambda s: s["end"])
    key = _part(last)
    chain = [s for s in trace.spans if _part(s) == key and
             ((s["pid"] == last["pid"] and s["name"] not in SERVER_STAGES) or
              (s["name"] in SERVER_STAGES and s["args"]["server"] == last["args"]["server"]))]
    return sorted(chain, key=lambda s: (s["ts"], s["end"]))


def summarize(trace):
    """Everything the summary prints, as plain data."""
    by_stage = collections.defaultdict(list)
    for s in trace.spans:
        by_stage[s["name"]].append(s["dur"])
    stages = {name: _stats(d) for name, d in by_stage.items()}
    servers = collections.defaultdict(lambda: {"push_us": [], "bytes": 0, "busy": [], "sum_us": []})
    for s in trace.spans:
        srv = s["args"].get("server")
        if srv is None or srv < 0:
            continue
        if s["name"] == "PUSH":
            servers[srv]["push_us"].append(s["dur"])
            servers[srv]["bytes"] += s["args"]["bytes"]
        elif s["name"] in ("RECV", "SUM", "REPLY"):
            servers[srv]["busy"].append((s["ts"], s["end"]))
            if s["name"] == "SUM":
                servers[srv]["sum_us"].append(s["dur"])
    per_server = {srv: {"pushes": len(v["push_us"]), "bytes": v["bytes"],
                        "mean_push_round_trip_us": statistics.fmean(v["push_us"]) if v["push_us"] else 0.0,
                        "busy_ms": union(v["busy"]) / 1e3,
                        "mean_sum_us": statistics.fmean(v["sum_us"]) if v["sum_us"] else 0.0}
                  for srv, v in sorted(servers.items())}
    busiest = max(per_server, key=lambda s: per_server[s]["busy_ms"]) if per_server else None
    bottleneck = max(per_server, key=lambda s: per_server[s]["mean_push_round_trip_us"]) if per_server else None
    steps = _steps(trace)
    per_step = {}
    for step, (s, e) in sorted(steps.items()):
        inside = [x for x in trace.worker_spans() if x["ts"] >= s and x["end"] <= e]
        per_step[step] = {"ms": (e - s) / 1e3, "queued_ms": union([(x["ts"], x["end"]) for x in inside
                                                                   if x["name"] == "QUEUE"]) / 1e3,
                          "on_wire_ms": union([(x["ts"], x["end"]) for x in inside if x["name"] == "PUSH"]) / 1e3}
    slowest = max(per_step, key=lambda k: per_step[k]["ms"]) if per_step else None
    queued = sum(by_stage.get("QUEUE", ())) / 1e3
    wire = sum(by_stage.get("PUSH", ())) / 1e3
    path = critical_path(trace, *steps[slowest]) if slowest is not None else critical_path(
        trace, float("-inf"), float("inf"))
    return {"stages": stages, "servers": per_server, "busiest_server": busiest, "bottleneck_server": bottleneck,
            "steps": per_step, "slowest_step": slowest, "queued_ms": queued, "on_wire_ms": wire,
            "critical_path": [{"process": trace.processes.get(s["pid"], s["pid"]), "stage": s["name"],
                               "start_us": s["ts"], "dur_us": s["dur"], "args": s["args"]} for s in path],
            "nodes": trace.nodes}


def text(summary):
    """The printed summary."""
    out = []
    add = out.append
    add("clock alignment (offset to the scheduler's clock, error bound):")
    for label, n in sorted(summary["nodes"].items()):
        c = n.get("clock") or {}
        err = n.get("clock_error_ns")
        add(f"  {label:<10} offset {c.get('offset_ns', 0) / 1e3:9.1f} us  ±{(err or 0) / 1e3:8.1f} us  "
            f"spans {n.get('spans')}  dropped {n.get('dropped_spans')}{'' if n.get('complete') else '  (incomplete)'}")
    add("")
    add(f"{'stage':<16}{'count':>8}{'total ms':>12}{'mean us':>11}{'p50 us':>11}{'max us':>11}")
    for name, s in sorted(summary["stages"].items(), key=lambda kv: -kv[1]["total_ms"]):
        add(f"{name:<16}{s['count']:>8}{s['total_ms']:>12.2f}{s['mean_us']:>11.1f}{s['p50_us']:>11.1f}{s['max_us']:>11.1f}")
    add("")
    add(f"{'server':<8}{'pushes':>8}{'MB':>10}{'push round trip us':>20}{'busy ms':>10}{'mean sum us':>13}")
    for srv, s in summary["servers"].items():
        add(f"{srv:<8}{s['pushes']:>8}{s['bytes'] / 1e6:>10.2f}{s['mean_push_round_trip_us']:>20.1f}"
            f"{s['busy_ms']:>10.2f}{s['mean_sum_us']:>13.1f}")
    if summary["busiest_server"] is not None:
        add(f"busiest server: {summary['busiest_server']} (most time receiving, summing and replying)")
    if summary["bottleneck_server"] is not None:
        srv = summary["bottleneck_server"]
        others = [s["mean_push_round_trip_us"] for k, s in summary["servers"].items() if k != srv]
        add(f"bottleneck: server {srv} (workers wait {summary['servers'][srv]['mean_push_round_trip_us']:.0f} us "
            f"per push round trip" + (f", the others {statistics.fmean(others):.0f} us)" if others else ")"))
    add(f"queued vs on the wire (partition-time): {summary['queued_ms']:.2f} ms queued, {summary['on_wire_ms']:.2f} ms "
        f"pushed until the reply")
    if summary["steps"]:
        add("")
        add(f"{'step':<6}{'ms':>10}{'queued ms':>12}{'on wire ms':>12}")
        for step, s in summary["steps"].items():
            add(f"{step:<6}{s['ms']:>10.2f}{s['queued_ms']:>12.2f}{s['on_wire_ms']:>12.2f}")
    if summary["critical_path"]:
        add("")
        first = summary["critical_path"][0]["start_us"]
        what = f"step {summary['slowest_step']}" if summary["slowest_step"] is not None else "the trace"
        a = summary["critical_path"][-1]["args"]
        add(f"critical path of the slowest {what}: tensor {a['tensor']!r} partition {a['partition']} "
            f"round {a['round']} (the last to finish)")
        for s in summary["critical_path"]:
            add(f"  +{s['start_us'] - first:10.1f} us  {s['dur_us']:9.1f} us  {s['stage']:<16}{s['process']}")
    return "\n".join(out)


def chart(trace, path):
    """A PNG: for each step, how long each stage was active on the workers (the union of its
    partitions' spans; stages overlap, so the stack can be taller than the step, marked in black)
    and the time with no communication at all (computation, Python)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _steps(trace)
    order = ["QUEUE", "STAGE", "LOCAL_REDUCE", "PUSH", "PULL", "LOCAL_BROADCAST", "COORDINATE"]
    rows = []
    for step, (s, e) in sorted(steps.items()):
        inside = [x for x in trace.worker_spans() if x["ts"] >= s and x["end"] <= e]
        comm = union([(x["ts"], x["end"]) for x in inside]) / 1e3
        rows.append((step, {st: union([(x["ts"], x["end"]) for x in inside if x["name"] == st]) / 1e3
                            for st in order}, (e - s) / 1e3 - comm, (e - s) / 1e3))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.4), 4))
    labels = [str(r[0]) for r in rows] or ["(no steps marked)"]
    bottom = [0.0] * len(rows)
    for st in order:
        vals = [r[1][st] for r in rows]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=st)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar(labels, [max(r[2], 0.0) for r in rows], bottom=bottom, label="no communication", color="lightgrey")
    ax.plot(labels, [r[3] for r in rows], "k_", markersize=20, label="step time")
    ax.set_xlabel("step")
    ax.set_ylabel("ms a stage was active (stages overlap)")
    ax.set_title("where each step's time went")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
