"""push_pull goodput and server CPU per transport, in the same run: direct TCP links, UCX.

One machine, ``bpslaunch --local --workers N`` (N single-process worker machines and N colocated
servers) with BYTEPS_ENABLE_IPC=0, so every partition crosses the transport under test instead of
byteps' shared-memory descriptors. The transports (docs/ucx.md):

* ``tcp``:     BYTEPS_TRANSPORT=tcp (direct TCP links, core/transport/bps_link.h)
* ``ucx-tcp``: BYTEPS_TRANSPORT=ucx, UCX_TLS=tcp (UCP Active Messages over UCX's tcp transport)
* ``ucx-sm``:  BYTEPS_TRANSPORT=ucx, UCX_TLS=sm,self,tcp, BYTEPS_UCX_PEER_ERRORS=0 (UCX's shared memory)

Jobs alternate between transports ``--repeat`` times, so load that comes and goes on the machine
hits each alike; each cell is the median over jobs. Goodput = tensor bytes / time per push_pull;
server CPU = the servers' user+system core-seconds during the timed loop, per GB of tensor pushed
by all workers.

    python bench/bench_transports.py                       # 2 workers, 4KB..64MB, 3 jobs each
    python bench/bench_transports.py --quick
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_push_pull import SIZES, run_job  # noqa: E402

TRANSPORTS = {
    "tcp": {"BYTEPS_TRANSPORT": "tcp"},
    "ucx-tcp": {"BYTEPS_TRANSPORT": "ucx", "UCX_TLS": "tcp"},
    "ucx-sm": {"BYTEPS_TRANSPORT": "ucx", "UCX_TLS": "sm,self,tcp", "BYTEPS_UCX_PEER_ERRORS": "0"},
    # UCX's own rendezvous threshold instead of byteps' 1 MB without an RDMA device (core/ucx.py; not in the default set)
    "ucx-tcp-rndv": {"BYTEPS_TRANSPORT": "ucx", "UCX_TLS": "tcp", "UCX_RNDV_THRESH": "auto"},
    "ucx-sm-rndv": {"BYTEPS_TRANSPORT": "ucx", "UCX_TLS": "sm,self,tcp", "BYTEPS_UCX_PEER_ERRORS": "0",
                    "UCX_RNDV_THRESH": "auto"},
    # UCX's tcp transport with 256 KB segments instead of its 8 KB default (not in the default set)
    "ucx-tcp-256k": {"BYTEPS_TRANSPORT": "ucx", "UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k",
                     "UCX_TCP_RX_SEG_SIZE": "256k"},
}
DEFAULT = "tcp,ucx-tcp,ucx-sm"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sizes", default="4KB,64KB,1MB,16MB,64MB")
    ap.add_argument("--transports", default=DEFAULT, help=f"a subset of {','.join(TRANSPORTS)}")
    ap.add_argument("--reps", type=int, default=20, help="push_pulls timed per size and job")
    ap.add_argument("--repeat", type=int, default=3, help="jobs per transport, alternating")
    ap.add_argument("--quick", action="store_true", help="3 sizes, 5 reps, 1 job each")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.reps, args.repeat = "4KB,1MB,16MB", 5, 1
    sizes = args.sizes.split(",")
    names = args.transports.split(",")
    runs = {}  # (transport, size) -> [(seconds per op, server core-seconds per GB)]
    for _ in range(args.repeat):
        for name in names:
            env = dict(TRANSPORTS[name], BYTEPS_ENABLE_IPC="0", BYTEPS_LOG_LEVEL="WARNING")
            res, _ = run_job(args.workers, args.workers, sizes, args.reps, env, layout="machines",
                             extra_args=["--cpu-only"])
            for label, r in res.items():
                gb = SIZES[label] * args.reps * args.workers / 1e9
                runs.setdefault((name, label), []).append((r["elapsed"] / args.reps, r["server_cpu"] / gb))
            print(f"# done: {name}", file=sys.stderr, flush=True)
    head = " | ".join(f"{n} MB/s" for n in names) + " | " + " | ".join(f"{n} CPU s/GB" for n in names)
    lines = [f"| size | {head} |", "|---|" + "---:|" * (2 * len(names))]
    for label in sizes:
        rates = [SIZES[label] / statistics.median(t for t, _ in runs[(n, label)]) / 1e6 for n in names]
        cpu = [statistics.median(c for _, c in runs[(n, label)]) for n in names]
        # CPU times tick in 10 ms: below 1 MB the timed loop is too short to say anything
        cpu_cells = [f"{c:.2f}" if SIZES[label] >= (1 << 20) else "-" for c in cpu]
        lines.append(f"| {label} | " + " | ".join(f"{r:.1f}" for r in rates) + " | " + " | ".join(cpu_cells) + " |")
    print("\n".join(lines))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"transports-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "runs": {f"{n}|{s}": v for (n, s), v in runs.items()}}, f, indent=1)
    print(f"# raw: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
