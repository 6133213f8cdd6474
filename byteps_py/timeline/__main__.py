"""``python -m byteps.timeline TRACE [--png OUT] [--json]``: summarize a job timeline (docs/timeline.md)."""
import argparse
import json
import sys

from . import report


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m byteps.timeline",
                                description="Summarize a byteps job timeline: time per stage, per server and "
                                            "per step, the busiest server, queued against on-the-wire time and "
                                            "the critical path of the slowest step.")
    p.add_argument("trace", help="the trace file (BYTEPS_TIMELINE / bpslaunch --timeline)")
    p.add_argument("--png", metavar="OUT", help="also draw where each step's time went (matplotlib)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    opts = p.parse_args(argv)
    try:
        trace = report.load(opts.trace)
    except (OSError, ValueError) as e:
        print(f"python -m byteps.timeline: cannot read {opts.trace}: {e}", file=sys.stderr)
        return 2
    summary = report.summarize(trace)
    print(json.dumps(summary, indent=1, default=str) if opts.json else report.text(summary))
    if opts.png:
        report.chart(trace, opts.png)
        print(f"chart written to {opts.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
