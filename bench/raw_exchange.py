"""The floor of a synchronous push_pull on this machine, without byteps: plain TCP, no framework.

``--clients 1`` is the raw round trip bench_users.py reports (one process sends N bytes, another
echoes them). ``--clients 2`` is what a push_pull of two single-process workers through one server
needs at least: each client sends N bytes to a server process, which answers both once both have
arrived. ``--busy-us`` makes each client spin that long before every call, as a training script's
Python runs between calls (byteps' own Python per synchronous call is about 10-20 us here).

On a machine with fewer cores than processes, the exchange with busy clients costs far more than
the sum of its parts: the server has to be scheduled in between the clients' work.

``--poll``: every process reads with non-blocking sockets in a loop (yielding its core between
reads) instead of sleeping in recv, so no process is ever woken: what the round trip costs without wake-ups (the reason for byteps'
BYTEPS_SPIN_US).

    python bench/raw_exchange.py --clients 1
    python bench/raw_exchange.py --clients 1 --poll
    python bench/raw_exchange.py --clients 2 --busy-us 15

bench_users.py quotes ``--clients 1`` beside its latency figures as the round trip a user would
measure: two fresh processes, bound to no CPU. Between hosts (network namespaces) the client runs
in another namespace (``--client-netns``) and reaches the server at its address (``--bind``).
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def _whole(io, buf):
    """Run ``io`` (a socket's ``recv_into`` or ``send``) until all of ``buf`` has gone through it; on a
    non-blocking socket (--poll) it is tried again at once, yielding the core in between as byteps'
    polling callers do (a process ready to run here goes first)."""
    view, done = memoryview(buf), 0
    while done < len(view):
        try:
            done += io(view[done:])
        except BlockingIOError:
            os.sched_yield()


def serve(listener, clients, size, calls, poll):
    conns = [listener.accept()[0] for _ in range(clients)]
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.setblocking(not poll)
    buf, reply = bytearray(size), b"r" * size
    for _ in range(calls):
        for c in conns:
            _whole(c.recv_into, buf)
        for c in conns:
            _whole(c.send, reply)


def client(addr, port, size, calls, busy_s, warmup, poll):
    sock = socket.create_connection((addr, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(not poll)
    msg, buf, times = b"c" * size, bytearray(size), []
    for _ in range(calls):
        start = time.perf_counter()
        while time.perf_counter() - start < busy_s:
            pass
        sent = time.perf_counter()
        _whole(sock.send, msg)
        _whole(sock.recv_into, buf)
        times.append(time.perf_counter() - sent)
    print(f"{statistics.median(times[warmup:]) * 1e6:.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--size", type=int, default=4096, help="bytes each way (default 4096)")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--busy-us", type=float, default=0.0, help="each client spins this long before a call")
    ap.add_argument("--poll", action="store_true", help="read with non-blocking sockets in a loop: nobody sleeps")
    ap.add_argument("--bind", default="127.0.0.1", help="the server's address (default 127.0.0.1)")
    ap.add_argument("--client-netns", help="start the clients in this network namespace (ip netns exec)")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "client":
        client(args.bind, args.port, args.size, args.calls, args.busy_us * 1e-6, args.calls // 10, args.poll)
        return
    listener = socket.socket()
    listener.bind((args.bind, 0))
    listener.listen()
    port = listener.getsockname()[1]
    netns = ["ip", "netns", "exec", args.client_netns] if args.client_netns else []
    procs = [subprocess.Popen([*netns, sys.executable, __file__, "--role", "client", "--bind", args.bind,
                               "--port", str(port), "--size",
                               str(args.size), "--calls", str(args.calls), "--busy-us", str(args.busy_us)]
                              + (["--poll"] if args.poll else []),
                              stdout=subprocess.PIPE, text=True) for _ in range(args.clients)]
    serve(listener, args.clients, args.size, args.calls, args.poll)
    medians = [float(p.communicate(timeout=60)[0]) for p in procs]
    print(f"{args.clients} client(s), {args.size} B, busy {args.busy_us:g} us{', polling' if args.poll else ''}: "
          f"median time from send to "
          f"reply {statistics.median(medians):.1f} us (clients: {', '.join(f'{m:.1f}' for m in medians)})")


if __name__ == "__main__":
    main()
