"""The summary of one bench/gpu_checks.sh run: its GPU tests' outcome and the benchmark ratios set against
the targets (CUDA push_pull >= 1.5x gloo from 16 MB and >= 1.0x at 1 MB; a training step >= 1.2x
DDP-gloo between 2 single-process machines).

    python bench/gpu_summary.py OUTDIR > OUTDIR/summary.md
"""
import json
import os
import re
import sys

PUSH_PULL_TARGETS = {"1MB": 1.0, "16MB": 1.5, "64MB": 1.5}
TRAIN_TARGET = 1.2
LAYOUT_NAMES = {"machines": "2 machines x 1", "local": "1 machine x 2"}


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _verdict(value, target):
    return "met" if value >= target else "NOT met"


def push_pull_lines(doc):
    out = ["| layout | size | pattern | byteps / gloo, median [min-max] | byteps ms | gloo ms | target |",
           "|---|---|---|---|---|---|---|"]
    for r in doc["ratios"]:
        target = PUSH_PULL_TARGETS.get(r["size"])
        mark = f">= {target}: {_verdict(r['ratio'], target)}" if target else ""
        out.append(f"| {LAYOUT_NAMES.get(r['layout'], r['layout'])} | {r['size']} | {r['pattern']} | "
                   f"{r['ratio']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] | {r['byteps_s'] * 1e3:.2f} | "
                   f"{r['gloo_s'] * 1e3:.2f} | {mark} |")
    if doc.get("errors"):
        out.append(f"\nWRONG RESULTS: {len(doc['errors'])}, e.g. {doc['errors'][:3]}")
    return out


def train_lines(doc):
    out = ["| layout | model MB | partition bytes | byteps / DDP-gloo, median [min-max] | losses equal | target |",
           "|---|---|---|---|---|---|"]
    tuned = doc.get("meta", {}).get("explicit_env")  # an A/B's variables: no target for a tuned figure
    for r in doc["results"]:
        target = TRAIN_TARGET if r["layout"] == "machines" and not tuned else None
        mark = f">= {target}: {_verdict(r['ratio'], target)}" if target else ""
        out.append(f"| {LAYOUT_NAMES.get(r['layout'], r['layout'])} | {r['model_bytes'] / 1e6:.1f} | "
                   f"{r.get('partition_bytes')} | {r['ratio']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] | "
                   f"{'yes' if r['losses_equal'] else 'NO'} | {mark or (f'set: {tuned}' if tuned else '')} |")
    return out


def tests_line(outdir):
    try:
        with open(os.path.join(outdir, "tests.log")) as f:
            lines = [ln.strip() for ln in f if re.search(r"\d+ (passed|failed|error)", ln)]
    except OSError:
        return "tests: not run"
    return f"tests: {lines[-1] if lines else 'no pytest summary line (see tests.log)'}"


def main(outdir):
    out = ["# GPU checks", ""]
    try:
        with open(os.path.join(outdir, "machine.txt")) as f:
            out += ["```", f.read().strip(), "```", ""]
    except OSError:
        pass
    out += [tests_line(outdir), ""]
    for label, title, lines in (("cuda", "CUDA push_pull vs gloo all_reduce (same CUDA tensors)", push_pull_lines),
                                ("train-cuda", "Training step, model on the GPU: byteps vs DDP-gloo", train_lines)):
        doc = _load(os.path.join(outdir, f"users-{label}.json"))
        out += [f"## {title}", ""]
        out += lines(doc) if doc else [f"not run (no users-{label}.json)"]
        out.append("")
    ab = [(label, _load(os.path.join(outdir, f"users-{label}.json")))
          for label in ("train-4mb-1", "train-default-2", "train-4mb-2")]
    if any(doc for _, doc in ab):
        out += ["## Partition size A/B, training between 2 machines (in order; the first default is above)", ""]
        for label, doc in ab:
            out += [f"{label}:"] + (train_lines(doc) if doc else ["not run"]) + [""]
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/gpu")
