"""The scheduler's side of the timeline: collect every node's spans and write one trace file.

Output is Chrome's JSON trace format, which the Perfetto UI reads (its tracks and events:
docs/timeline.md, "What is in the trace"). Every track's slices nest properly, as Perfetto
requires of JSON traces.
"""
import json
import os
import time

import numpy as np

from .spans import SERVER_STAGES, SPAN_DTYPE, STAGES, decode

SCHEDULER_PID = 1
STEPS_TID = 1  # the steps track of a worker (a real thread id is never 1 in a worker process)
#: stages that are a partition waiting, not its thread working: many overlap on one thread, and
#: Perfetto shows only properly nested slices on a track, so they go on lanes of their own
WAITS = frozenset({"QUEUE", "PUSH", "ROUND", "COORDINATE"})
LANE_TID_BASE = 1 << 24  # above Linux's largest thread id (pid_max <= 2^22)


class Lanes:
    """Tracks for overlapping waits of one process: a span goes on the first lane of its (thread,
    stage) that is free when it starts (spans must come in start order)."""

    def __init__(self, pid, threads):
        self.pid, self.threads = pid, threads
        self.lanes = {}   # (tid, stage) -> [(end, lane tid)]
        self.next = LANE_TID_BASE
        self.names = []   # thread_name events of the lanes

    def tid(self, tid, stage, t0, t1):
        lanes = self.lanes.setdefault((tid, stage), [])
        for i, (end, lane) in enumerate(lanes):
            if end <= t0:
                lanes[i] = (t1, lane)
                return lane
        lane = self.next
        self.next += 1
        lanes.append((t1, lane))
        owner = self.threads.get(tid, f"thread {tid}")
        self.names.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": lane,
                           "args": {"name": f"{owner}: {stage} #{len(lanes)}"}})
        return lane


class NodeTrace:
    """What one node sent, on its own clock; :meth:`offset` moves it onto the scheduler's.

    One offset per node: the estimate with the tightest error bound of all it reported (its probes
    go on through the job). A single shift keeps the node's own spans in their exact order; a
    per-batch shift would not (a span sent in one batch and the next stage in another)."""

    def __init__(self):
        self.node = {}
        self.batches = []    # arrays of spans.SPAN_DTYPE, times in the node's CLOCK_MONOTONIC ns
        self.marks = []      # (step, t in the node's ns)
        self.threads = {}
        self.dropped = 0
        self.keys = {}       # tensor key (a string: JSON) -> tensor name
        self.clocks = []     # every estimate it reported
        self.final = False

    def add(self, body):
        self.node.update(body.get("node") or {})
        clock = body.get("clock") or {}
        if clock.get("samples") and (not self.clocks or self.clocks[-1] != clock):
            self.clocks.append(clock)
        if body.get("spans"):
            self.batches.append(decode(body["spans"]))
        self.marks += [(step, t) for step, t, _ in body.get("marks") or ()]
        self.threads.update({int(k): v for k, v in (body.get("threads") or {}).items()})
        self.dropped += int(body.get("dropped") or 0)
        self.keys.update({str(k): v for k, v in (body.get("keys") or {}).items()})
        self.final = self.final or bool(body.get("final"))

    def label(self):
        n = self.node
        if n.get("role") == "server":
            return f"server {n.get('index')}"
        if n.get("role") == "worker":
            return f"worker {n.get('rank')}"
        return f"node pid {n.get('pid')}"

    def pid(self):
        """The node's track in the trace: servers first, then workers, by index and rank."""
        n = self.node
        if n.get("role") == "server" and n.get("index") is not None:
            return 10 + n["index"]
        if n.get("rank") is not None:
            return 1000 + n["rank"]
        return 100000 + int(n.get("pid") or 0)

    def spans(self):
        if len(self.batches) != 1:
            self.batches = [np.concatenate(self.batches) if self.batches else np.empty(0, SPAN_DTYPE)]
        return self.batches[0]

    def best_clock(self):
        return min(self.clocks, key=lambda c: c["error_ns"]) if self.clocks else None

    def offset(self):
        c = self.best_clock()
        return int(c["offset_ns"]) if c else 0

    def error_ns(self):
        """The error bound of the offset used (None: never measured)."""
        c = self.best_clock()
        return c["error_ns"] if c else None


class Collector:
    """TRACE messages by sender identity; the scheduler calls :meth:`write` at the end (and on stop)."""

    def __init__(self, path):
        self.path = path
        self.nodes = {}
        self.known = set()   # identities that were in an address book: the only ones we accept
        self.started_ns = time.monotonic_ns()

    def expect(self, ident):
        self.known.add(ident)

    def add(self, ident, body):
        """Take one TRACE body; False if the sender never was a member of the job."""
        if ident not in self.known:
            return False
        if not self.path and body.get("path"):  # start_timeline(path) on a worker names the file
            self.path = body["path"]
        self.nodes.setdefault(ident, NodeTrace()).add(body)
        return True

    def missing_finals(self, alive):
        """Identities in ``alive`` that have not sent their last spans yet."""
        return [i for i in alive if i in self.known and not (i in self.nodes and self.nodes[i].final)]

    def events(self):
        keys = {}
        for n in self.nodes.values():
            keys.update(n.keys)
        events = [{"ph": "M", "name": "process_name", "pid": SCHEDULER_PID, "args": {"name": "scheduler (clock reference)"}},
                  {"ph": "M", "name": "process_sort_index", "pid": SCHEDULER_PID, "args": {"sort_index": 0}}]
        ts = [int(n.spans()["t0"].min()) + n.offset() for n in self.nodes.values() if len(n.spans())] + \
            [t + n.offset() for n in self.nodes.values() for _, t in n.marks]
        base = min(ts) if ts else self.started_ns
        us = lambda t: round((t - base) / 1000, 3)  # noqa: E731 (ns on the scheduler's clock -> trace us)
        for n in sorted(self.nodes.values(), key=NodeTrace.pid):
            pid = n.pid()
            off = n.offset()
            err = n.error_ns()
            bound = "clock not measured" if err is None else f"clock ±{err / 1000:.1f} us"
            host = n.node.get("host", "?")
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"{n.label()} (pid {n.node.get('pid')} on {host}; {bound})"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
            for tid, name in n.threads.items():
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            server_node = n.node.get("role") == "server"
            lanes = Lanes(pid, n.threads)
            for t0, t1, key, rnd, nbytes, prio, server, peer, tid, stage in sorted(n.spans().tolist()):
                name = STAGES.get(stage, str(stage))
                if name in WAITS:
                    tid = lanes.tid(tid, name, t0, t1)
                tkey, part = key >> 32, key & 0xFFFFFFFF
                args = {"tensor": keys.get(str(tkey), f"key {tkey}"), "partition": part,
                        "round": rnd, "bytes": nbytes}
                if server_node:
                    args["server"] = n.node.get("index")
                    if name == "RECV":
                        args["rank"] = peer
                else:
                    args["server"] = server
                    args["priority"] = prio
                events.append({"ph": "X", "cat": "byteps", "name": name, "pid": pid, "tid": tid, "ts": us(t0 + off),
                               "dur": round(max(t1 - t0, 0) / 1000, 3), "args": args})
            events += lanes.names
            if n.marks:
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": STEPS_TID,
                               "args": {"name": "steps"}})
                marks = sorted((step, t + off) for step, t in n.marks)
                # step N runs from mark N-1 to mark N (the first from the first span this worker recorded)
                first = int(n.spans()["t0"].min()) + off if len(n.spans()) else marks[0][1]
                prev = min(first, marks[0][1])
                for step, t in marks:
                    events.append({"ph": "X", "cat": "step", "name": f"step {step}", "pid": pid, "tid": STEPS_TID,
                                   "ts": us(prev), "dur": round((t - prev) / 1000, 3), "args": {"step": step}})
                    prev = t
        other = {"base_ns": base, "nodes": {
            n.label(): {"pid": n.pid(), "clock": n.best_clock(), "clock_estimates": len(n.clocks),
                        "clock_error_ns": n.error_ns(),
                        "dropped_spans": n.dropped, "complete": n.final, "spans": len(n.spans())}
            for n in self.nodes.values()}, "server_stages": list(SERVER_STAGES)}
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"byteps": other}}

    def write(self):
        """Write the trace to ``path`` atomically (a temporary file renamed over it); the path or None."""
        if not self.path:
            return None
        trace = self.events()
        path = os.path.abspath(self.path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        os.replace(tmp, path)
        return path
