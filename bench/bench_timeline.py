"""What the job timeline costs (docs/timeline.md, "Cost").

A 2-worker, 2-server job on loopback (``bpslaunch --local``) runs tests/timeline_worker.py: each
step "computes" for ``--sleep`` seconds, then push_pulls three tensors (1,000 + 300,000 + 1,500,000
float32, 7.2 MB) and checks the sums. The same job runs with the timeline off and on
(``--timeline``), alternating, ``--reps`` times each; every worker writes its step times.

Reported per mode: the median step time over all steps but the first two of every run and worker
(start-up), and the spread of the runs' medians; the overhead is on/off - 1. Also the CPU seconds the
whole job used (less sensitive than step times to other load on the machine). Off, each stage
boundary of the native threads costs one relaxed atomic load (core/pipeline/bps_trace.h) and the Python
paths one attribute test; on, a clock read and a 64-byte append under a mutex per span, plus the
sends to the scheduler every BYTEPS_TIMELINE_FLUSH_STEPS steps.

    python bench/bench_timeline.py [--steps 40] [--reps 2] [--sleep 0.02] [--sizes N,N,...] [--json out.json]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "timeline_worker.py")


def run(mode, steps, sleep, sizes, tmp):
    times = os.path.join(tmp, f"times-{mode}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("BYTEPS_TIMELINE", "BYTEPS_PARTITION_BYTES", "BYTEPS_SCHEDULING_CREDIT"):
        env.pop(name, None)
    argv = [sys.executable, "-m", "byteps.launcher", "--local", "--workers", "2", "--servers", "2", "--timeout", "300"]
    if mode == "on":
        argv += ["--timeline", os.path.join(tmp, "bench.trace.json")]
    argv += ["--", sys.executable, WORKER, str(steps), "--sleep", str(sleep), "--sizes", sizes, "--times", times]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=330)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if res.returncode != 0:
        raise SystemExit(f"{mode} run failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    out = []
    for rank in (0, 1):
        with open(f"{times}.{rank}") as f:
            out += [float(x) for x in f.read().split()][2:]
    return out, cpu


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.02, help="seconds of 'computation' per step")
    p.add_argument("--sizes", default="1000,300000,1500000",
                   help="tensor sizes in float32 elements (many small ones: the most spans per step)")
    p.add_argument("--json", help="write the results here")
    opts = p.parse_args()
    results = {"off": [], "on": []}
    cpus = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-timeline-") as tmp:
        for _ in range(opts.reps):
            for mode in ("off", "on"):
                times, cpu = run(mode, opts.steps, opts.sleep, opts.sizes, tmp)
                results[mode].append(times)
                cpus[mode].append(cpu)
        trace_bytes = os.path.getsize(os.path.join(tmp, "bench.trace.json"))
    summary = {}
    for mode, runs in results.items():
        medians = [statistics.median(r) for r in runs]
        summary[mode] = {"median_step_ms": 1e3 * statistics.median([t for r in runs for t in r]),
                         "run_medians_ms": [round(1e3 * m, 2) for m in medians],
                         # CPU seconds of the whole job (launcher, scheduler, servers, workers), start-up included
                         "job_cpu_s": [round(c, 2) for c in cpus[mode]]}
    overhead = summary["on"]["median_step_ms"] / summary["off"]["median_step_ms"] - 1
    report = {"steps": opts.steps, "reps": opts.reps, "sleep_s": opts.sleep, "sizes": opts.sizes, "modes": summary,
              "overhead": overhead, "trace_bytes_last_run": trace_bytes, "cpus": os.cpu_count()}
    print(f"{'mode':<6}{'median step ms':>16}   run medians (ms)   job CPU s")
    for mode, s in summary.items():
        print(f"{mode:<6}{s['median_step_ms']:>16.2f}   {s['run_medians_ms']}   {s['job_cpu_s']}")
    print(f"overhead with the timeline on: {100 * overhead:+.1f}% of the step time; trace "
          f"{trace_bytes / 1e6:.1f} MB for {opts.steps} steps")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
