"""Direct TCP links between the native threads (core/transport/bps_link.h): the data path without ZeroMQ.

* exact sums of every dtype with every server reached over a link (proved by the workers' link
  count), over TCP and with shared-memory descriptors;
* partitions of 8 MiB over the network path: messages larger than a socket buffer, written in
  pieces (the send queue, POLLOUT) and each reply's sum read straight into the tensor (no PULL copy);
  a reply that comes after its op failed is not read into the tensor its caller has back;
* the handshake against a real server: an authenticated job member gets a one-time token over
  ZeroMQ; a wrong token is refused and the link closed; the right one is accepted once; a PROBE sent
  on the link is echoed on the link (Python's reply leaves through the native thread's send_to);
  a peer that never authenticated gets no token;
* ZeroMQ is the control plane only: a job member's data messages on its DEALER are refused with an
  ERROR and never enter a sum.
"""
import os
import socket
import sys
import time

import pytest
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from conftest import ask_link, member_dealer, server_data_port  # noqa: E402
from test_push_pull import SMALL_SHAPES, check_matrix  # noqa: E402

from byteps.core import transport, wire  # noqa: E402
from byteps.core.wire import Cmd  # noqa: E402

POINTS = [(2, 2, False), (3, 1, True)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,k,ipc", POINTS, ids=[f"{n}w{k}s-{'shm' if i else 'tcp'}" for n, k, i in POINTS])
def test_exact_sums_over_direct_links(cluster, n, k, ipc):
    res = check_matrix(cluster, n, k, SMALL_SHAPES + [(3, 257)], rounds=3, ipc=ipc)
    assert [res[r]["native_links"] for r in range(n)] == [k] * n, res


@pytest.mark.timeout(180)
def test_partitions_larger_than_the_socket_buffers(cluster):
    """8 MiB partitions over TCP (no shared memory): each message is written in several pieces
    and each reply read straight into the tensor; 3 rounds of 12-24 MiB float32 and int64 tensors."""
    res = check_matrix(cluster, 2, 2, [(3 << 20,)], rounds=3, ipc=False, extreme=False, dtypes=["float32", "int64"],
                       extra_env={"BYTEPS_PARTITION_BYTES": str(8 << 20)})
    assert [res[r]["native_links"] for r in range(2)] == [2, 2], res
    # every partition of 64 KB or more: its sum went from the TCP socket into the tensor, not via a
    # message (a UCX link, make test-ucx, reads into its own buffers)
    for r in range(2):
        pulled = res[r]["stages"].get("pull", 0)
        placed = pulled if res[r]["link_transports"] == ["tcp", "tcp"] else 0
        assert pulled >= 3 * (2 + 3) and res[r]["replies_in_place"] == placed, (r, res[r]["stages"], res[r])


@pytest.mark.timeout(150)
def test_a_late_reply_is_not_read_into_a_tensor_whose_call_failed(cluster):
    """Rank 0's push_pull of a 4 MB tensor over TCP fails by BYTEPS_TIMEOUT because rank 1 calls late;
    rank 0 fills the tensor it has back with 7s. When rank 1 calls, the server sends both their sums:
    rank 0's tensor keeps its 7s (the reply is dropped, not read into it), rank 1 gets the exact sum."""
    timeout = 8  # also bounds start-up, which takes a few seconds on a loaded 2-core machine
    c = cluster(2, 2, env={"BYTEPS_TIMEOUT": str(timeout), "BYTEPS_ENABLE_IPC": "0",
                           "BYTEPS_PARTITION_BYTES": str(1 << 20)})
    c.run_workers("late_reply", {"delay": timeout + 6})
    codes, _, _ = c.wait_all(120)
    assert codes == [0, 0], c.all_logs()
    res = c.results()
    assert all("value" in res[r] for r in (0, 1)), f"{res}\n{c.all_logs()}"
    r0, r1 = res[0]["value"], res[1]["value"]
    assert r0["error"].startswith("BytePSTimeoutError") and "'late'" in r0["error"], r0
    assert r0["rank1_done"] and r0["kept"], r0
    # 1 + 2; both calls' partitions read into the tensor on rank 1, only the first call's on rank 0
    assert r1["got"] == [3], r1
    if res[0]["link_transports"] == ["tcp", "tcp"]:  # UCX links (make test-ucx) read into their own buffers
        assert r1["in_place"] == 2 * r0["in_place"] > 0, (r0, r1)


# ------------------------------------------------------------------------------ the handshake, raw


def _member(port):
    ctx = zmq.Context()
    sock, ident = member_dealer(ctx, port)
    return ctx, sock, ident


def _hello(port, token, ident):
    """Present ``token`` on a new link; the server's answer (arg 1: accepted) and the socket."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(transport.link_pack([wire.pack(Cmd.LINK, length=16 + len(ident)), token + ident]))
    return wire.unpack(transport.link_recv(s)[0]), s


@pytest.mark.timeout(150)
def test_link_handshake_against_a_real_server(cluster):
    c = cluster(2, 1, env={"BYTEPS_LOG_LEVEL": "INFO"})
    c.run_workers("wait_then_sum", {"wait": 120})
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(c.tmp, f"progress.{r}")) for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in c.workers), c.all_logs()
        time.sleep(0.05)
    port = server_data_port(c.servers[0].pid)
    ctx, sock, ident = _member(port)
    try:
        answer = ask_link(sock)
        # a UCX server also offers its listener (tests/test_ucx.py; `make test-ucx` runs this file over UCX)
        ucx = {"ucx_port"} if os.environ.get("BYTEPS_TRANSPORT") == "ucx" else set()
        assert set(answer) == {"port", "token"} | ucx, answer
        token = bytes.fromhex(answer["token"])
        assert len(token) == 16

        wrong = bytes(b ^ 0xFF for b in token)
        header, s = _hello(answer["port"], wrong, ident)
        assert header.cmd == Cmd.LINK and header.arg == 0, header
        s.settimeout(10)
        assert s.recv(1) == b"", "a refused link must be closed"
        s.close()

        header, link = _hello(answer["port"], token, ident)
        assert header.cmd == Cmd.LINK and header.arg == 1, header
        # Python answers PROBE; its reply leaves through the native thread, on our link
        body = os.urandom(3000)
        link.sendall(transport.link_pack([wire.pack(Cmd.PROBE, key=7, round=3, length=len(body)), body]))
        frames = transport.link_recv(link)
        echo = wire.unpack(frames[0])
        assert (echo.cmd, echo.key, echo.round, frames[1]) == (Cmd.PROBE, 7, 3, body)
        assert not sock.poll(300), "the echo must come on the link, not on ZeroMQ"

        header, again = _hello(answer["port"], token, ident)  # one use only
        assert header.arg == 0, header
        again.close()
        link.close()
    finally:
        ctx.destroy(linger=0)

    # a peer that never authenticated asks too: no token (the server logs and ignores it)
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(f"tcp://127.0.0.1:{port}")
        stranger.send_multipart(wire.control(Cmd.LINK))
        assert not stranger.poll(1000), "a stranger got an answer to LINK"
    finally:
        ctx.destroy(linger=0)

    open(os.path.join(c.tmp, "go"), "w").close()
    codes, scodes, sched = c.wait_all(120)
    assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()
    for r, res in c.results().items():  # the job sums exactly, over its own links
        assert res.get("value") == {"before": True, "after": True, "after_i": True}, (r, res, c.all_logs())
        assert res["native_links"] == 1, res
    assert "refused a direct link" in c.log("server0")


@pytest.mark.timeout(150)
def test_data_over_zeromq_is_refused_and_the_job_sums_exactly(cluster):
    """ZeroMQ is the control plane only: an authenticated job member's PUSHPULL, BROADCAST,
    ASYNC_PUSHPULL and RESULT for the job's own keys, sent on its DEALER, are each answered with an
    ERROR that says partitions travel over direct links only, and never enter a round: the job's
    sums stay exact (each checked against the locally computed one); the DEALER still gets control."""
    c = cluster(2, 1)
    c.run_workers("wait_then_sum", {"wait": 120})
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(c.tmp, f"progress.{r}")) for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in c.workers), c.all_logs()
        time.sleep(0.05)
    ctx, sock, _ = _member(server_data_port(c.servers[0].pid))
    try:
        body = bytes(4096)  # float32 zeros: well-formed, the length the header says
        # the job's first tensor keys, the round each is at or comes to next, as ranks 0 and 1 would send
        sent = []
        for i, cmd in enumerate([Cmd.PUSHPULL, Cmd.BROADCAST, Cmd.ASYNC_PUSHPULL, Cmd.RESULT]):
            key = wire.make_key(1 + i % 3, 0)
            rnd = 1 if key == wire.make_key(1, 0) else 0
            sock.send_multipart([wire.pack(cmd, sender=i % 2, key=key, round=rnd, length=len(body), dtype=0), body])
            sent.append(key)
        answers = []
        deadline = time.monotonic() + 20
        while len(answers) < len(sent) and time.monotonic() < deadline:
            if sock.poll(100):
                answers.append(sock.recv_multipart())
        assert len(answers) == len(sent), f"{len(answers)} of {len(sent)} data messages over ZeroMQ answered\n" \
                                          f"{answers}\n{c.log('server0')}"
        for header, text in answers:
            h = wire.unpack(header)
            error = wire.decode(text).get("error", "")
            assert h.cmd == Cmd.ERROR and "over ZeroMQ" in error, (Cmd(h.cmd).name, error)
        assert sorted(wire.unpack(a[0]).key for a in answers) == sorted(sent), answers
        assert "token" in ask_link(sock)  # control still arrives on ZeroMQ
    finally:
        ctx.destroy(linger=0)
    open(os.path.join(c.tmp, "go"), "w").close()
    codes, scodes, sched = c.wait_all(120)
    assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()
    assert sorted(c.results()) == [0, 1], c.all_logs()
    for r, res in c.results().items():  # every sum exact against the locally computed one
        assert res.get("value") == {"before": True, "after": True, "after_i": True}, (r, res, c.all_logs())


def test_a_server_without_a_direct_link_fails_init_naming_it():
    """No ZeroMQ fallback: where a server's link cannot be opened (here its port refuses connections),
    the worker's start-up fails naming the server, its address and why."""
    import types

    from byteps.core.engine_setup import EngineSetup
    from byteps.errors import BytePSError
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    engine = types.SimpleNamespace(cfg=types.SimpleNamespace(timeout=5.0, node_host="127.0.0.1"),
                                   control=types.SimpleNamespace(node_id=3))
    with pytest.raises(BytePSError, match=rf"no direct link to server 1 \(127.0.0.1:{port}\): .*refused.*"
                                          r"partitions travel over direct links only"):
        EngineSetup._open_server_link(engine, f"server 1 (127.0.0.1:{port})", "127.0.0.1",
                                      {"port": port, "token": "00" * transport.TOKEN_BYTES}, b"worker-ident")


# ------------------------------------------------------------------------------ direct calls


DIRECT_CASES = {
    "alone": {"steps": 200},
    "late-peer": {"steps": 30, "late_steps": [3, 4, 10, 20], "late_ranks": [1]},
    "beside-async": {"steps": 200, "busy": True},
}


def run_direct_case(cluster, case, env):
    """2 worker machines and 2 servers run DIRECT_CASES[case]; their results, every one checked exact."""
    c = cluster(2, 2, env=dict(env, BYTEPS_PARTITION_BYTES="65536"))
    c.run_workers("direct_calls", DIRECT_CASES[case])
    codes, scodes, sched = c.wait_all(120)
    assert codes == [0, 0] and scodes == [0, 0] and sched == 0, c.all_logs()
    results = c.results()
    for r, res in results.items():
        assert res["value"]["exact"], (r, res["value"], c.all_logs())
    return results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(DIRECT_CASES))
def test_synchronous_calls_on_the_callers_thread(cluster, case):
    """Synchronous 4 KB calls run their round trip on the caller's thread (most of them: byteps-net
    must be idle); a late peer makes the caller hand its partition to byteps-net, and async traffic on
    the same links must reach its owners; every result exact."""
    steps = DIRECT_CASES[case]["steps"]
    for res in run_direct_case(cluster, case, {}).values():
        v = res["value"]
        assert res["native_links"] == 2, res
        # every call's partition went through PUSH and PULL of its stage list, on the caller's thread or not
        assert res["stages"].get("push", 0) == res["stages"].get("pull", 0) >= 2 * steps, res["stages"]
        if case == "alone":  # nothing else in flight: nearly every call takes the fast path
            assert v["direct"] >= 300, v
        elif case == "late-peer":
            assert v["direct"] > 0, v


def run_direct_calls(cluster, machines, local_size, args):
    """The "direct_calls" scenario on ``machines`` machines of ``local_size`` processes (a server each):
    every process exits cleanly with exact results, each linked to every other local rank; the results."""
    c = cluster(machines, machines, local_size=local_size, env={"BYTEPS_PARTITION_BYTES": "65536"})
    c.run_workers("direct_calls", args)
    codes, scodes, sched = c.wait_all(120)
    assert codes == [0] * (machines * local_size) and scodes == [0] * machines and sched == 0, c.all_logs()
    res = c.results()
    for r, got in res.items():
        assert got["value"]["exact"], (r, got["value"], c.all_logs())
        assert got["native_local"]["links_up"] == local_size - 1, got["native_local"]
    return res


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(DIRECT_CASES))
@pytest.mark.parametrize("machines", [1, 2], ids=["1x2", "2x2"])
def test_synchronous_local_reduce_calls_on_the_callers_thread(cluster, case, machines):
    """With a local reduce, a process that does not own a small tensor's partition sends its copy to the
    owner and reads the owner's LOCAL_DONE on its own thread (submit_local_direct); a late owner makes it
    hand the partition to byteps-net; async local-reduce traffic on the same links reaches its owners;
    every result exact. "small" and "small.oop" have consecutive keys, so each process owns one."""
    res = run_direct_calls(cluster, machines, 2, DIRECT_CASES[case])
    direct = sum(got["value"]["direct"] for got in res.values())
    adopted = sum(got["value"]["adopted"] for got in res.values())
    if case == "alone":  # half the calls are a non-owner's; most take the fast path (a loaded machine
        # may make a reply miss the 5 ms window: at least half, where none did before)
        assert direct >= 100 * machines * 2, (direct, adopted)
    elif case == "late-peer":  # rank 1 sleeps 50 ms on 4 steps: rank 0 waits longer than the window
        assert direct > 0 and adopted > 0, (direct, adopted)
    # the owner's side runs on its caller's thread too where the machine is the whole job (its sum is the
    # result); with servers it goes through byteps-net
    for got in res.values():  # every call's partition went through its stage list, whichever thread ran it
        st = got["stages"]
        assert st.get("local_broadcast", 0) >= 2 * DIRECT_CASES[case]["steps"], st
        assert st.get("coordinate", 0) + st.get("local_reduce", 0) == st.get("local_broadcast", 0), st
    owned = [got["native_local"]["owner_direct"] for got in res.values()]
    if machines == 2:
        assert owned == [0] * 4, owned
    elif case == "alone":  # each process owns one of the two tensors: 200 calls each
        assert min(owned) >= 100, owned
    else:
        assert sum(owned) > 0, owned


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["alone", "late-peer"])
def test_owner_calls_on_the_callers_thread_with_four_processes(cluster, case):
    """One machine of 4 processes (the whole job): the owner of a small tensor's partition takes the other
    three copies (from byteps-net when they came first, else from their links), sums them and answers on
    its own thread (submit_owner_direct); a late rank makes it hand the partition to byteps-net with the
    copies it had taken; every result exact."""
    res = run_direct_calls(cluster, 1, 4, dict(DIRECT_CASES[case], steps=60))
    owned = sum(got["native_local"]["owner_direct"] for got in res.values())
    adopted = sum(got["value"]["adopted"] for got in res.values())
    assert owned >= 30, owned  # 120 calls of an owned tensor in all (2 tensors x 60 steps)
    if case == "late-peer":
        assert adopted > 0, adopted
