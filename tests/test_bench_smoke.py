"""Smoke runs of the users'-conditions benchmarks: bench/bench_users.py (push_pull vs gloo, default
environment) and bench/bench_gil.py (progress without the GIL). Each must exit 0 and write its JSON
with the keys the docs and the lead's scripts read. Timings are not checked: this only proves the
benchmarks still run against the current engine. The bench_gil run is marked slow (run with -m slow)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, json_path, timeout):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BYTEPS_", "DMLC_"))}
    res = subprocess.run([sys.executable, *args, "--json", str(json_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    with open(json_path) as f:
        return json.load(f), res.stdout


@pytest.mark.timeout(180)
def test_bench_users_tiny(tmp_path):
    doc, out = _run(["bench/bench_users.py", "--quick", "--layouts", "local", "--procs", "2", "--sizes", "4KB,1MB",
                     "--patterns", "inplace", "--names", "fixed", "--repeat", "1"], tmp_path / "users.json", 150)
    assert {"meta", "results", "ratios", "latency", "child"} <= set(doc)
    assert doc["meta"]["mode"] == "collectives"
    assert {(r["size"], r["impl"]) for r in doc["results"]} == {(s, i) for s in ("4KB", "1MB")
                                                                for i in ("byteps", "gloo", "rtt")}
    for r in doc["results"]:
        assert r["median_s"] > 0 and r["goodput_GBps"] > 0 and r["reps"] == 1
    for q in doc["ratios"]:
        assert {"layout", "procs", "size", "pattern", "names", "ratio", "ratio_min", "ratio_max"} <= set(q)
    assert {q["size"] for q in doc["latency"]} == {"4KB", "1MB"}
    assert all(q["rtt_s"] > 0 for q in doc["latency"])
    # the round trip beside each repetition's blocks, and byteps' time over it
    assert all(q["rtt_beside_s"] > 0 and q["byteps_over_rtt_beside"] > 0 for q in doc["latency"])
    # and the round trip of two fresh processes the driver started (raw_exchange.py)
    assert all(q["fresh_rtt_s"] > 0 and q["byteps_over_fresh_rtt"] > 0 for q in doc["latency"])
    assert all(r["workers_cpu_per_call"] > 0 for r in doc["results"] if r["impl"] in ("byteps", "gloo"))
    assert not doc.get("errors")
    assert "| local | 2 | 4KB | inplace | fixed |" in out


@pytest.mark.timeout(240)
def test_bench_users_hosts_tiny(tmp_path):
    """The hosts layout: 2 hosts (network namespaces), unshaped; the namespaces are gone afterwards."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import netns

    why = netns.available()
    if why:
        pytest.skip(why)
    doc, out = _run(["bench/bench_users.py", "--quick", "--layouts", "hosts", "--host-rates", "0", "--procs", "2",
                     "--sizes", "4KB,1MB", "--patterns", "inplace", "--names", "fixed", "--repeat", "1"],
                    tmp_path / "hosts.json", 210)
    assert {r["layout"] for r in doc["results"]} == {"hosts"}
    assert {(r["size"], r["impl"]) for r in doc["results"]} == {(s, i) for s in ("4KB", "1MB")
                                                                for i in ("byteps", "gloo", "rtt")}
    assert all(q["fresh_rtt_s"] > 0 and q["rtt_s"] > 0 for q in doc["latency"])
    assert {"worker", "server", "scheduler"} <= set(doc["cpu_by_role"]["hosts,2"])
    assert not doc.get("errors")
    assert "| hosts | 2 | 1MB | inplace | fixed |" in out
    assert doc["namespaces_left"] == {"hosts,2": []}  # the job's network namespaces, after it closed


@pytest.mark.slow  # about 20-25 s (two jobs with pinned cores); the users' test above takes about 13 s
@pytest.mark.timeout(180)
def test_bench_gil_quick(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("bench_gil.py needs two cores")
    doc, out = _run(["bench/bench_gil.py", "--quick"], tmp_path / "gil.json", 150)
    assert {"meta", "results", "threads"} <= set(doc)
    got = {(r["system"], r["case"]) for r in doc["results"]}
    assert got == {(s, c) for s in ("byteps", "gloo") for c in ("64MB", "256x64KB")}
    for r in doc["results"]:
        assert {"wait_s", "spin_s", "ratio", "speed_rel", "start_us_per_op", "correct"} <= set(r)
        assert r["correct"] and r["wait_s"] > 0 and r["spin_s"] > 0
    for system, info in doc["threads"].items():  # everything but the training thread on the other core
        comm = doc["meta"]["args"]["comm_core"]
        assert all(t["cpus"] == [comm] for t in info["threads_end"] if t["tid"] != info["training_tid"]), system
    assert "| byteps | 64MB |" in out


def test_figures_print_readme_tables():
    """bench/figures.py prints README's performance tables: the same headers, cells as min-max over runs."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import figures

    got = {("local", 2): {"ratios": [{"pattern": p, "size": s, "ratio": r} for p in figures.PATTERNS
                                     for s, r in (("16MB", 1.5), ("64MB", 2.25), ("4KB", 9.0))],
                          "latency": [{"size": "4KB", "pattern": "inplace", "byteps_s": t, "gloo_s": 1e-3,
                                       "fresh_rtt_s": 2e-5, "byteps_over_fresh_rtt": t / 2e-5,
                                       "byteps_over_rtt_beside": 1.0} for t in (3e-5, 4e-5)]}}
    goodput = figures.goodput_table(got, 3, figures.LARGE).splitlines()
    latency = figures.latency_table(got, 1).splitlines()
    assert goodput[2] == "| one machine, 2 worker processes | 1.50-2.25x | 1.50-2.25x | 1.50-2.25x | 3 runs |"
    assert latency[2] == "| one machine, 2 worker processes | 30-40 | 1000 | 20 | 1.50-2.00x | 1.00x | measured once |"
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for header in (goodput[0], latency[0], figures.TRAIN_HEADER, figures.CLUSTER_HEADER):
        assert header in readme, header
    assert figures.span([]) == "—"
