"""The job timeline (docs/timeline.md): real jobs write one trace, its spans nest across machines
after clock alignment, the summary names a slowed server, a dead worker costs only its own spans.

Each job checks exact sums too (tests/timeline_worker.py asserts them). The trace is read back with
``json`` and, where its binary can be had, with Perfetto's own trace processor.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import Cluster

from byteps.timeline import report

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "timeline_worker.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import netns  # noqa: E402


def _label(trace, pid):
    return trace.processes[pid].split(" (")[0]


def check_trace(path, workers, servers, steps):
    """Every partition's spans are there and in order; every push's RECV on its server lies within
    the worker's PUSH span, up to the two nodes' stated clock error bounds. Returns the Trace."""
    trace = report.load(path)
    labels = sorted(_label(trace, pid) for pid in trace.processes)
    assert labels == sorted(["scheduler"] + [f"server {i}" for i in range(servers)] +
                            [f"worker {r}" for r in range(workers)]), labels
    err_us = {label: (n["clock_error_ns"] or 0) / 1e3 for label, n in trace.nodes.items()}
    assert all(n["complete"] and n["dropped_spans"] == 0 for n in trace.nodes.values()), trace.nodes
    assert all(n["clock"]["samples"] >= 1 for n in trace.nodes.values()), trace.nodes
    threads = {name for (pid, _), name in trace.threads.items()}
    assert {"byteps-net", "byteps-serve", "steps"} <= threads, threads
    for pid, marks in trace.steps.items():
        assert [m[0] for m in sorted(marks)] == list(range(1, steps + 1)), marks

    # Perfetto shows a JSON track's slices only if they nest: no two on one track may overlap partly
    tracks = {}
    for s in trace.spans:
        tracks.setdefault((s["pid"], s["tid"]), []).append(s)
    for key, spans in tracks.items():
        open_ends = []
        for s in sorted(spans, key=lambda s: (s["ts"], -s["end"])):
            while open_ends and open_ends[-1] <= s["ts"] + 0.002:  # the trace rounds to 1 ns
                open_ends.pop()
            assert not open_ends or s["end"] <= open_ends[-1] + 0.002, (key, s, open_ends)
            open_ends.append(s["end"])

    pushes = [s for s in trace.spans if s["name"] == "PUSH"]
    pairs = report.pairs(trace)
    assert pushes and len(pairs) == len(pushes), f"{len(pushes)} pushes, {len(pairs)} with a server RECV"
    strict = 0
    for push, recv in pairs:
        tol = err_us[_label(trace, push["pid"])] + err_us[_label(trace, recv["pid"])]
        assert push["ts"] - tol <= recv["ts"] and recv["end"] <= push["end"] + tol, (push, recv, tol)
        strict += push["ts"] <= recv["ts"] and recv["end"] <= push["end"]
    # the bound is not a blanket: most pushes nest exactly (on a loaded 2-core machine the offsets
    # are off by tens of microseconds, about a RECV's length)
    assert strict >= 0.5 * len(pairs), (strict, len(pairs))
    # on one worker, one partition's stages follow each other (one clock: exact)
    by_part = {}
    for s in trace.worker_spans():
        by_part.setdefault((s["pid"],) + report._part(s), {})[s["name"]] = s
    for part, st in by_part.items():
        assert set(st) == {"QUEUE", "STAGE", "PUSH", "PULL"} or set(st) == {"QUEUE", "PUSH", "PULL"}, (part, st)
        order = [st[n] for n in ("QUEUE", "STAGE", "PUSH", "PULL") if n in st]
        for a, b in zip(order, order[1:]):
            assert a["end"] <= b["ts"] + 1, (part, a, b)  # +1 us: the trace rounds to ns/1000
    return trace


def _job(tmp_path, servers, env, path):
    """2 workers running 4 steps of tests/timeline_worker.py (exact sums) under ``env``: the trace at ``path``."""
    c = Cluster(str(tmp_path), 2, servers, env=env).start()
    try:
        for wid in range(2):
            c.workers.append(c._spawn([sys.executable, WORKER, "4"], "worker", {"DMLC_WORKER_ID": str(wid)},
                                      log=f"worker{wid}.log"))
        codes, _, sched_code = c.wait_all(60)
    finally:
        c.kill_all()
    assert codes == [0, 0] and sched_code == 0, c.all_logs()
    return report.load(path)


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    """2 workers and 2 servers on loopback, started by bpslaunch --timeline."""
    tmp = tmp_path_factory.mktemp("timeline")
    path = str(tmp / "job.trace.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", BYTEPS_TIMELINE_FLUSH_STEPS="3", BYTEPS_TIMELINE_CLOCK_INTERVAL="0.2")
    env.pop("BYTEPS_TIMELINE", None)
    res = subprocess.run([sys.executable, "-m", "byteps.launcher", "--local", "--workers", "2", "--servers", "2",
                          "--timeline", path, "--timeout", "120", "--", sys.executable, WORKER, "8"],
                         env=env, capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return path


@pytest.mark.timeout(200)
def test_loopback_job_writes_one_trace_whose_spans_nest(loopback):
    trace = check_trace(loopback, workers=2, servers=2, steps=8)
    assert not [n for n in os.listdir(os.path.dirname(loopback)) if ".tmp" in n]  # written atomically
    # both servers summed: RECV of both workers, SUM, ROUND and REPLY on each
    for i in (0, 1):
        names = {s["name"] for s in trace.server_spans() if s["args"]["server"] == i}
        assert names == {"RECV", "SUM", "ROUND", "REPLY"}, (i, names)
    tensors = {s["args"]["tensor"] for s in trace.spans}
    assert tensors == {"layer0", "layer1", "layer2"}, tensors


@pytest.mark.timeout(200)
def test_summary_and_chart(loopback, tmp_path):
    png = str(tmp_path / "steps.png")
    res = subprocess.run([sys.executable, "-m", "byteps.timeline", loopback, "--png", png], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for needle in ("clock alignment", "PUSH", "QUEUE", "busiest server:", "bottleneck: server",
                   "queued vs on the wire", "critical path of the slowest step"):
        assert needle in out, (needle, out)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    summary = report.summarize(report.load(loopback))
    assert sorted(summary["steps"]) == list(range(1, 9))
    # the critical path ends with the partition's PULL on a worker and includes its server's SUM
    stages = [s["stage"] for s in summary["critical_path"]]
    assert stages[-1] == "PULL" and "SUM" in stages and "PUSH" in stages, stages


@pytest.mark.timeout(200)
def test_compressed_push_pulls_record_the_same_stages(tmp_path):
    """Compressed push_pulls (encoded and decoded by the workers' native core, summed by the servers'):
    byteps-net records QUEUE, PUSH, PULL, the server RECV, ROUND, REPLY on byteps-serve, and the
    pushes nest in the same way. The sums are small integers, exact in fp16."""
    path = str(tmp_path / "py.trace.json")
    trace = _job(tmp_path, 2, {"BYTEPS_TIMELINE": path, "BYTEPS_COMPRESSOR": "fp16"}, path)
    names = {s["name"] for s in trace.spans}
    assert {"QUEUE", "PUSH", "PULL", "RECV", "ROUND", "REPLY"} <= names, names
    pulls = {trace.threads.get((s["pid"], s["tid"])) for s in trace.spans if s["name"] == "PULL"}
    recvs = {trace.threads.get((s["pid"], s["tid"])) for s in trace.spans if s["name"] == "RECV"}
    assert pulls == {"byteps-net"} and recvs == {"byteps-serve"}, (pulls, recvs)
    err_us = {label: (n["clock_error_ns"] or 0) / 1e3 for label, n in trace.nodes.items()}
    pairs = report.pairs(trace)
    assert pairs and len(pairs) == len([s for s in trace.spans if s["name"] == "PUSH"])
    for push, recv in pairs:
        tol = err_us[_label(trace, push["pid"])] + err_us[_label(trace, recv["pid"])]
        assert push["ts"] - tol <= recv["ts"] and recv["end"] <= push["end"] + tol, (push, recv, tol)


def _trace_processor_binary():
    """The trace_processor_shell the perfetto package would use, or None. The package downloads it on
    first use; this machine cannot (no route to get.perfetto.dev), so a test run here needs
    BYTEPS_TRACE_PROCESSOR=PATH or a copy left by an earlier download."""
    import tempfile

    for path in (os.environ.get("BYTEPS_TRACE_PROCESSOR"),
                 os.path.join(tempfile.gettempdir(), "trace_processor_python_api")):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@pytest.mark.timeout(200)
def test_perfetto_trace_processor_reads_the_same_nesting(loopback):
    tp_mod = pytest.importorskip("perfetto.trace_processor")
    binary = _trace_processor_binary()
    if binary is None:
        pytest.skip("Perfetto's trace_processor_shell is not available offline; set BYTEPS_TRACE_PROCESSOR")
    tp = tp_mod.TraceProcessor(trace=loopback, config=tp_mod.TraceProcessorConfig(bin_path=binary))
    try:
        rows = list(tp.query("""
            select s.name as name, s.ts as ts, s.dur as dur, p.name as process,
                   extract_arg(s.arg_set_id, 'args.tensor') as tensor,
                   extract_arg(s.arg_set_id, 'args.partition') as part,
                   extract_arg(s.arg_set_id, 'args.round') as rnd,
                   extract_arg(s.arg_set_id, 'args.server') as server,
                   extract_arg(s.arg_set_id, 'args.rank') as rank
            from slice s join thread_track tt on s.track_id = tt.id join thread using(utid)
                 join process p using(upid)
            where s.category = 'byteps' and s.name in ('PUSH', 'RECV')"""))
    finally:
        tp.close()
    trace = report.load(loopback)
    err_ns = {label: n["clock_error_ns"] or 0 for label, n in trace.nodes.items()}
    recv = {(r.tensor, r.part, r.rnd, r.server, r.rank): r for r in rows if r.name == "RECV"}
    pushes = [r for r in rows if r.name == "PUSH"]
    assert pushes
    for p in pushes:
        worker = p.process.split(" (")[0]
        r = recv[(p.tensor, p.part, p.rnd, p.server, int(worker.split()[1]))]
        tol = err_ns[worker] + err_ns[r.process.split(" (")[0]]
        assert p.ts - tol <= r.ts and r.ts + r.dur <= p.ts + p.dur + tol


@pytest.mark.timeout(200)
def test_a_dead_worker_costs_only_its_own_unsent_spans(tmp_path):
    """Rank 1 is SIGKILLed after step 4; spans go to the scheduler every 2 steps. The scheduler reports
    the lost worker and still writes one trace with the survivors' spans up to the end (they send
    them on the ABORT), and rank 1's up to its last send."""
    path = str(tmp_path / "dead.trace.json")
    c = Cluster(str(tmp_path), 2, 2, env={"BYTEPS_TIMELINE": path, "BYTEPS_TIMELINE_FLUSH_STEPS": "2"}).start()
    try:
        for wid in range(2):
            c.workers.append(c._spawn([sys.executable, WORKER, "30", "--die-after", "4", "--sleep", "0.05"],
                                      "worker", {"DMLC_WORKER_ID": str(wid)}, log=f"worker{wid}.log"))
        codes, server_codes, sched_code = c.wait_all(60)
    finally:
        c.kill_all()
    assert sched_code == 1 and codes[1] == -9 and codes[0] != 0, (codes, sched_code, c.all_logs())
    trace = report.load(path)
    labels = {label: n for label, n in trace.nodes.items()}
    assert {"worker 0", "worker 1", "server 0", "server 1"} <= set(labels), labels
    assert labels["worker 0"]["complete"] and labels["server 0"]["complete"] and labels["server 1"]["complete"]
    assert not labels["worker 1"]["complete"]  # it died before its last send
    steps = {_label(trace, pid): sorted(m[0] for m in marks) for pid, marks in trace.steps.items()}
    # the send after step 2 is in; the one after step 4 races the kill (the engine thread sends)
    assert steps["worker 1"][:2] == [1, 2] and steps["worker 1"] == list(range(1, len(steps["worker 1"]) + 1)) \
        and len(steps["worker 1"]) <= 4, steps
    assert steps["worker 0"][:4] == [1, 2, 3, 4], steps


@pytest.mark.timeout(200)
def test_start_and_stop_timeline_without_the_variable(tmp_path):
    """Horovod's API: start_timeline(path) on the workers after step 1 makes every node record;
    stop_timeline() after step 3 sends it; the scheduler writes the path the workers named."""
    path = str(tmp_path / "hvd.trace.json")
    c = Cluster(str(tmp_path), 2, 1).start()
    try:
        for wid in range(2):
            c.workers.append(c._spawn([sys.executable, WORKER, "5", "--start-timeline", path, "--stop-after", "3"],
                                      "worker", {"DMLC_WORKER_ID": str(wid)}, log=f"worker{wid}.log"))
        codes, _, sched_code = c.wait_all(60)
    finally:
        c.kill_all()
    assert codes == [0, 0] and sched_code == 0, c.all_logs()
    trace = report.load(path)
    steps = {_label(trace, pid): sorted(m[0] for m in marks) for pid, marks in trace.steps.items()}
    # only what was recorded between the calls; a worker may start a step early (the first start_timeline()
    # anywhere starts every node: the scheduler relays it)
    assert all(s[-2:] == [2, 3] and set(s) <= {1, 2, 3} for s in steps.values()) and len(steps) == 2, steps
    assert any(s["name"] == "SUM" for s in trace.server_spans())  # the server recorded too


def test_off_records_nothing():
    """Without BYTEPS_TIMELINE nothing is recorded: the native threads test one relaxed atomic
    (bench/bench_timeline.py measures it)."""
    from byteps import timeline
    from byteps.core import _trace, _worker_core

    assert timeline.recorder is None
    timeline.mark_step()
    assert timeline.recorder is None
    raw, dropped = _trace.drain(_worker_core.trace_buffer())
    assert raw == b"" and dropped == 0


@pytest.mark.timeout(200)
def test_span_buffers_are_bounded_and_count_what_they_drop(tmp_path):
    """BYTEPS_TIMELINE_BUFFER=3 and one send at the end: each node's native buffer keeps its first 3
    spans of the job and counts the rest as dropped; the sums are still exact (the worker checks)."""
    path = str(tmp_path / "small.trace.json")
    env = {"BYTEPS_TIMELINE": path, "BYTEPS_TIMELINE_BUFFER": "3", "BYTEPS_TIMELINE_FLUSH_STEPS": "0"}
    trace = _job(tmp_path, 1, env, path)
    for label, node in trace.nodes.items():
        if label == "scheduler":
            continue
        pids = [pid for pid in trace.processes if _label(trace, pid) == label]
        held = [s for s in trace.spans if s["pid"] in pids]
        assert 0 < len(held) <= 3 and node["dropped_spans"] > 0, (label, len(held), node)


def test_clock_estimate_uses_the_tightest_round_trip():
    from byteps.timeline import Clock

    c = Clock(1.0)
    # true offset +1000 ns; a symmetric 200 ns trip and an asymmetric 10 us one
    c.on_reply({"t0": 0, "t1": 1100, "t2": 1150}, 250)
    c.on_reply({"t0": 0, "t1": 10_000, "t2": 10_010}, 2_000)
    est = c.estimate()
    assert est["offset_ns"] == 1000 and est["error_ns"] == 100 and est["samples"] == 2


_WHY = netns.available()


@pytest.mark.skipif(_WHY is not None, reason=f"emulated cluster unavailable: {_WHY}")
@pytest.mark.timeout(240)
def test_emulated_cluster_trace_nests_and_names_the_slowed_server(tmp_path):
    """Workers w0, w1, servers on x0 and x1, the scheduler on its own host; x1's link alone is slowed to
    100 Mbit/s each way (tc tbf on both ends; the others are veths at memory speed). The trace's spans
    nest after clock alignment across the namespaces, and the summary names x1's server as the
    bottleneck."""
    path = str(tmp_path / "emu.trace.json")
    with netns.Network(["w0", "w1", "x0", "x1", "sched"]) as net:
        for ns, dev in ((net.ns["x1"], "eth0"), (net.switch, net.port_of["x1"])):  # both directions
            netns._run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "100mbit",
                       "burst", "36000", "limit", "6000000")
        base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", BYTEPS_HEARTBEAT_INTERVAL="0.5",
                    BYTEPS_HEARTBEAT_TIMEOUT="10", BYTEPS_TIMEOUT="60", BYTEPS_JOB_SECRET="emu-timeline-secret",
                    DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="2", DMLC_PS_ROOT_URI=net.addr["sched"],
                    DMLC_PS_ROOT_PORT="9000", BYTEPS_PARTITION_BYTES="512000", BYTEPS_SCHEDULING_CREDIT="4")
        for name in ("DMLC_ROLE", "DMLC_NODE_HOST", "DMLC_INTERFACE", "DMLC_WORKER_ID", "BYTEPS_TIMELINE"):
            base.pop(name, None)
        procs, logs = [], []

        def start(host, tag, argv, **extra):
            log = open(os.path.join(str(tmp_path), f"{tag}.log"), "wb")
            logs.append(log.name)
            env = dict(base, DMLC_NODE_HOST=net.addr[host], **extra)
            procs.append(net.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()

        start("sched", "scheduler", [sys.executable, "-m", "byteps.scheduler"], DMLC_ROLE="scheduler",
              BYTEPS_TIMELINE=path)
        for host in ("x0", "x1"):
            start(host, f"server-{host}", [sys.executable, "-m", "byteps.server"], DMLC_ROLE="server")
        for i in range(2):
            start(f"w{i}", f"worker{i}", [sys.executable, WORKER, "6"], DMLC_ROLE="worker", DMLC_WORKER_ID=str(i))
        try:
            codes = [p.wait(180) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
        tails = "\n".join(f"----- {n}\n{open(n, errors='replace').read()[-2000:]}" for n in logs)
        assert codes == [0] * len(procs), (codes, tails)
    assert net.exists() == []
    trace = check_trace(path, workers=2, servers=2, steps=6)
    slow = [pid for pid, name in trace.processes.items() if name.startswith("server") and net.addr["x1"] in name]
    assert len(slow) == 1, trace.processes
    slow_index = int(_label(trace, slow[0]).split()[1])
    summary = report.summarize(trace)
    assert summary["bottleneck_server"] == slow_index, summary["servers"]
    assert f"bottleneck: server {slow_index}" in report.text(summary)
    fast = summary["servers"][1 - slow_index]["mean_push_round_trip_us"]
    assert summary["servers"][slow_index]["mean_push_round_trip_us"] > 3 * fast, summary["servers"]
