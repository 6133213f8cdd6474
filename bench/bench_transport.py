"""Cost of one data-plane message: core/_transport.pyx (libzmq called from C) against pyzmq.

A DEALER sends ROUTER ``[40-byte header, 32-byte shared-memory descriptor]`` messages over loopback
TCP, the shape of a colocated partition's push; the ROUTER takes each whole, as the server does.
Reported: microseconds per message, send plus receive, in one process (so both sides' Python and
libzmq calls are counted, and ZeroMQ's I/O thread runs alongside). Median of ``--reps`` batches,
the two implementations alternating.

Two figures, which measure different things:

* **per message, 100 in flight** (the default): the CPU cost of the calls, amortised over a window
  of 100 messages, as when a large tensor's partitions stream. Not a latency.
* **round trip, one in flight** (``--pingpong``): one message at a time, the ROUTER echoing it back,
  as a synchronous small push_pull pays it at the least: two trips through ZeroMQ's I/O threads and
  the loopback TCP stack, mostly wake-ups, not the calls.

    python bench/bench_transport.py               # both
    python bench/bench_transport.py --no-pingpong # the per-message table only
"""
import argparse
import statistics
import time

import zmq

from byteps.core import transport, wire


def pair(ctx):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"worker-0")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.2)  # the TCP handshake
    return router, dealer


class PyzmqMessages:
    """The same interface through pyzmq's Python API: the comparison (byteps itself always uses the C path)."""

    def __init__(self, sock):
        self.sock = sock

    def recv_multipart(self):
        try:
            frames = [self.sock.recv(zmq.NOBLOCK)]
        except zmq.Again:
            return None
        while self.sock.getsockopt(zmq.RCVMORE):
            frame = self.sock.recv(copy=False)
            frames.append(frame.bytes if len(frame) < transport.COPY_BELOW else frame)
        return frames

    def send_multipart(self, frames):
        self.sock.send_multipart(frames, copy=True)


def batch(send, recv, frames, n, window=100):
    """Seconds per message for n messages, at most ``window`` in flight."""
    start = time.perf_counter()
    for i in range(0, n, window):
        for _ in range(window):
            send(frames)
        got = 0
        while got < window:
            if recv() is not None:
                got += 1
    return (time.perf_counter() - start) / n


def pingpong(dealer_tx, dealer_rx, router_tx, router_rx, frames, n):
    """Seconds per round trip: one message to the ROUTER, echoed back, ``n`` times in a row."""
    start = time.perf_counter()
    for _ in range(n):
        dealer_tx(frames)
        got = None
        while got is None:
            got = router_rx()
        router_tx(got)
        back = None
        while back is None:
            back = dealer_rx()
    return (time.perf_counter() - start) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pingpong", action=argparse.BooleanOptionalAction, default=True,
                    help="also time round trips with one message in flight (default: yes)")
    ap.add_argument("--round-trips", type=int, default=2000)
    args = ap.parse_args()
    ctx = zmq.Context()
    router, dealer = pair(ctx)
    frames = [wire.pack(wire.Cmd.PUSHPULL, key=1 << 32, round=0, length=4096, flags=wire.FLAG_SHM), bytes(32)]
    impls = {
        "byteps transport, libzmq direct": (transport.wrap(dealer), transport.wrap(router)),
        "the same interface over pyzmq": (PyzmqMessages(dealer), PyzmqMessages(router)),
    }

    def pyzmq_recv():  # what the server did before: a call and a RCVMORE check per frame
        try:
            ident = router.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        out = [ident]
        while router.getsockopt(zmq.RCVMORE):
            out.append(router.recv())
        return out

    runs = {name: [] for name in impls}
    runs["pyzmq per frame (send_multipart copy=False, recv per frame)"] = []
    for _ in range(args.reps):
        for name, (tx, rx) in impls.items():
            runs[name].append(batch(tx.send_multipart, rx.recv_multipart, frames, args.messages))
        runs["pyzmq per frame (send_multipart copy=False, recv per frame)"].append(
            batch(lambda f: dealer.send_multipart(f, copy=False), pyzmq_recv, frames, args.messages))
    base = statistics.median(runs["byteps transport, libzmq direct"])
    print(f"# {args.messages} messages x {args.reps} reps, [40 B header, 32 B descriptor], loopback TCP, "
          f"libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}")
    print("| implementation | us per message (send + receive) | vs libzmq direct |")
    print("|---|---:|---:|")
    for name, times in runs.items():
        med = statistics.median(times)
        print(f"| {name} | {med * 1e6:.2f} | {med / base:.2f}x |")
    if args.pingpong:
        trips = {name: [] for name in impls}
        wrapped = impls
        for _ in range(args.reps):
            for name, (tx, rx) in wrapped.items():
                trips[name].append(pingpong(tx.send_multipart, tx.recv_multipart, rx.send_multipart, rx.recv_multipart,
                                            frames, args.round_trips))
        print()
        print(f"# round trips, one message in flight: {args.round_trips} x {args.reps} reps, same messages echoed")
        print("| implementation | us per round trip (2 messages) |")
        print("|---|---:|")
        for name, times in trips.items():
            print(f"| {name} | {statistics.median(times) * 1e6:.1f} |")
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
