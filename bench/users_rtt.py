"""Round trips that bench_users.py puts beside its latency figures: raw TCP and ZeroMQ round trips
between worker ranks 0 and 1 inside the job (before and after the collectives, and a block beside
each latency block), and the round trip of two fresh processes bound to no CPU that the driver
starts (bench/raw_exchange.py): the one a user measuring a round trip would get."""
import os
import re
import socket
import subprocess
import sys
import time

from users_common import SIZES

HERE = os.path.dirname(os.path.abspath(__file__))


def rtt_connection(dist, rank, host, port):
    """A TCP connection (TCP_NODELAY) between ranks 0 and 1 for raw round trips; None on other ranks."""
    conn = srv = None
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(1)
    dist.barrier()
    if rank == 1:
        conn = socket.create_connection((host, port), timeout=60)
    elif rank == 0:
        srv.settimeout(60)
        conn, _ = srv.accept()
        srv.close()
    if conn is not None:
        conn.settimeout(60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def round_trips(conn, rank, nbytes, count, warm=10):
    """``count`` round trips of ``nbytes`` on ``conn`` (rank 0 sends, rank 1 echoes), after ``warm``
    untimed ones; rank 0 returns their times in seconds, rank 1 an empty list."""
    view = memoryview(bytearray(nbytes))
    times = []
    for i in range(count + warm):
        if rank == 0:
            t0 = time.perf_counter()
            conn.sendall(view)
            _recv_exact(conn, view)
            if i >= warm:
                times.append(time.perf_counter() - t0)
        else:
            _recv_exact(conn, view)
            conn.sendall(view)
    return times


def raw_rtt(dist, conn, rank, labels, count):
    """Loopback TCP round trip times (seconds) of each size between ranks 0 and 1; {} on other ranks."""
    out = {}
    if conn is not None:
        for label in labels:
            times = round_trips(conn, rank, SIZES[label], count)
            if rank == 0:
                out[label] = times
    dist.barrier()
    return out


def zmq_rtt(dist, rank, host, labels, count):
    """Median ZeroMQ round trip (seconds) of each size between ranks 0 and 1 over loopback TCP: rank 0's
    DEALER sends ``[40-byte header, N bytes]``, rank 1's ROUTER echoes it (pyzmq, one message in
    flight): the carrier of byteps' data messages before its direct TCP links; {} on other ranks."""
    import zmq

    ctx = zmq.Context()
    sock = None
    box = [None]
    if rank == 1:  # on its own host's address (hosts layout: another namespace than rank 0's)
        mine = os.environ.get("DMLC_NODE_HOST") or host
        sock = ctx.socket(zmq.ROUTER)
        box[0] = (mine, sock.bind_to_random_port(f"tcp://{mine}"))
    ports = [None] * dist.get_world_size()
    dist.all_gather_object(ports, box[0])
    if rank == 0:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://{ports[1][0]}:{ports[1][1]}")
    out = {}
    if sock is not None:
        sock.setsockopt(zmq.RCVTIMEO, 60000)
        header = bytes(40)
        for label in labels:
            body = bytes(SIZES[label])
            times = []
            for i in range(count + 10):
                if rank == 0:
                    t0 = time.perf_counter()
                    sock.send_multipart([header, body], copy=False)
                    sock.recv_multipart(copy=False)
                    if i >= 10:
                        times.append(time.perf_counter() - t0)
                else:
                    sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
            if rank == 0:
                out[label] = times
        sock.close(linger=1000)  # linger=0 could drop rank 1's last echo, leaving rank 0 waiting for it
    ctx.term()
    dist.barrier()
    return out


def _recv_exact(conn, view):
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("raw TCP peer closed the connection")
        got += k


def fresh_rtt(labels, calls=1000, server_prefix=(), bind="127.0.0.1", client_netns=None):
    """Median raw TCP round trip (seconds) of each size between two fresh processes bound to no CPU
    (bench/raw_exchange.py, started by this driver): the round trip a user would measure."""
    out = {}
    for label in labels:
        cmd = [*server_prefix, sys.executable, os.path.join(HERE, "raw_exchange.py"), "--clients", "1", "--size",
               str(SIZES[label]), "--calls", str(calls), "--bind", bind]
        res = subprocess.run(cmd + (["--client-netns", client_netns] if client_netns else []), capture_output=True,
                             text=True, timeout=300)
        found = re.search(r"reply ([0-9.]+) us", res.stdout)
        if not found:
            raise SystemExit(f"raw_exchange.py failed ({res.returncode}): {res.stdout}{res.stderr}")
        out[label] = float(found.group(1)) * 1e-6
    return out


def fresh_rtt_of(before, after):
    """{size: mean of the round trips measured before and after a job}."""
    return {label: (before[label] + after[label]) / 2 for label in before if label in after}
