"""The UCX transport (core/transport/bps_ucx.h, BYTEPS_TRANSPORT=ucx) over UCX's tcp and shared-memory transports.

These machines have no RDMA NIC, so UCX runs its tcp and sm (posix) transports here; the code path is
the one a verbs host runs (docs/ucx.md). Skipped, with the reason, where byteps was built without UCX
headers or no libucp loads.
"""
import os
import re
import signal
import sys
import time

import pytest
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from conftest import ask_link, member_dealer, server_data_port  # noqa: E402
from test_faults import _wait_progress, kill_a_worker  # noqa: E402
from test_push_pull import SMALL_SHAPES, check_matrix  # noqa: E402

from byteps.core import _worker_core, ucx  # noqa: E402

_OK, _WHY = ucx.load(_worker_core)
pytestmark = pytest.mark.skipif(not _OK, reason=f"UCX unavailable: {_WHY}")

UCX_ENV = {"BYTEPS_TRANSPORT": "ucx"}
# an endpoint's transports can be asked from UCX 1.14 on (older ones say "?": e.g. Debian 12's 1.13,
# loaded with RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true)
_VERSION = tuple(int(x) for x in _WHY.split()[1].split(".")[:2]) if _OK else (0, 0)
NAMES_TRANSPORTS = _VERSION >= (1, 14)


def _assert_ucx(res, n, k):
    """Every worker reached every server over a UCX link (not TCP, not ZeroMQ)."""
    for r in range(n):
        assert res[r]["native_links"] == k, res[r]
        kinds = res[r]["link_transports"]
        assert len(kinds) == k and all(t.startswith("ucx") for t in kinds), kinds


# (machines, servers, byteps' shared memory for colocated servers, UCX_TLS, what UCX must have used)
POINTS = [(2, 2, False, "tcp", "tcp/"), (3, 1, True, "tcp", "tcp/"), (2, 2, False, "sm,self,tcp", "memory")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,k,ipc,tls,used", POINTS,
                         ids=[f"{n}w{k}s-{'ipc' if i else 'net'}-{t}" for n, k, i, t, _ in POINTS])
def test_exact_sums_over_ucx(cluster, n, k, ipc, tls, used):
    env = dict(UCX_ENV, UCX_TLS=tls)
    if "sm" in tls:  # UCX's shared-memory transports cannot detect a dead peer: only without that
        env["BYTEPS_UCX_PEER_ERRORS"] = "0"
    res = check_matrix(cluster, n, k, SMALL_SHAPES + [(3, 257)], rounds=3, ipc=ipc, extra_env=env)
    _assert_ucx(res, n, k)
    if NAMES_TRANSPORTS:
        assert all(used in t for r in range(n) for t in res[r]["link_transports"]), res[0]["link_transports"]



@pytest.mark.timeout(180)
def test_large_partitions_over_ucx_rendezvous(cluster):
    """8 MiB partitions: UCX's rendezvous protocol. A partition's body travels alone (the "split" form,
    its header inside the Active Message's), so each reply is received contiguously straight into a
    pooled buffer that the worker registered with ucp_mem_map the first time and whose registration
    every later reply into it passes (ucp_request_param_t.memh); float32 and int64, 3 rounds."""
    made = []

    def keep(*args, **kwargs):  # the job, for its servers' logs
        made.append(cluster(*args, **kwargs))
        return made[-1]

    res = check_matrix(keep, 2, 2, [(3 << 20,)], rounds=3, ipc=False, extreme=False, dtypes=["float32", "int64"],
                       extra_env=dict(UCX_ENV, UCX_TLS="tcp", BYTEPS_PARTITION_BYTES=str(8 << 20),
                                      BYTEPS_LOG_LEVEL="INFO"))
    _assert_ucx(res, 2, 2)
    if _VERSION >= (1, 14):  # older UCX cannot take a registration with a request (then its cache does)
        for r in range(2):
            mapped, used = res[r]["ucx_registrations"]
            # every call pattern, 3 rounds: each buffer is mapped once and its registration used in every
            # round (a registration per reply would make used == mapped)
            assert mapped >= 1 and used >= 3 * mapped, res[r]["ucx_registrations"]
        for s in range(2):  # a server: the buffers pushes land in, and the store arenas replies leave from
            log = made[0].log(f"server{s}")
            m = re.search(r"UCX registrations: (\d+) receive buffers and store arenas mapped \(ucp_mem_map\), "
                          r"(\d+) transfers passed one", log)
            assert m, log[-3000:]
            mapped, used = int(m.group(1)), int(m.group(2))
            # a key's two stores take turns (round r uses store r % 2), so each arena's registration serves
            # fewer rounds than a receive buffer's: 4.3x was seen; one registration per transfer would be 1x
            assert mapped >= 1 and used >= 2 * mapped, (mapped, used)

# ------------------------------------------------------------------------------ authentication


def _endpoint(port, token, ident):
    """A UCX endpoint from a fresh native worker core to the server's UCX listener, presenting
    ``token``: "" when the server admitted it, else why not."""
    core = _worker_core.WorkerCore(99, 1 << 20, 10.0, 1, os.open(os.devnull, os.O_WRONLY))
    core.add_server()
    why = core.add_ucx_link(0, "127.0.0.1", port, token, ident, 10.0)
    del core  # closes the endpoint
    return why


@pytest.mark.timeout(150)
def test_ucx_endpoint_admitted_only_with_its_token(cluster):
    """The LINK answer of an authenticated member carries the UCX listener's port with the one-time
    token; an endpoint that presents a wrong token, or none, is refused and closed; the right token
    is accepted once. Meanwhile the job's own workers sum exactly over their UCX links."""
    c = cluster(2, 1, env=dict(UCX_ENV, BYTEPS_LOG_LEVEL="INFO"))
    c.run_workers("wait_then_sum", {"wait": 120})
    _wait_progress(c, [0, 1], timeout=60)
    port = server_data_port(c.servers[0].pid)
    ctx = zmq.Context()
    try:
        sock, ident = member_dealer(ctx, port)
        answer = ask_link(sock)
        assert {"token", "ucx_port"} <= set(answer), answer
        token, ucx_port = bytes.fromhex(answer["token"]), int(answer["ucx_port"])

        wrong = bytes(b ^ 0xFF for b in token)
        assert "refused" in _endpoint(ucx_port, wrong, ident)
        assert "refused" in _endpoint(ucx_port, b"", ident)           # no token at all
        assert "refused" in _endpoint(ucx_port, token, b"stranger")   # the token is another identity's
        # a first message over 64 KB (a rendezvous the server would allocate for) closes the endpoint
        assert _endpoint(ucx_port, token, ident + bytes(100 << 10)) not in ("", None)
        assert _endpoint(ucx_port, token, ident) == ""                  # the right one: admitted
        assert "refused" in _endpoint(ucx_port, token, ident)         # once
    finally:
        ctx.destroy(linger=0)

    open(os.path.join(c.tmp, "go"), "w").close()
    codes, scodes, sched = c.wait_all(120)
    assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()
    for r, res in c.results().items():
        assert res.get("value") == {"before": True, "after": True, "after_i": True}, (r, res, c.all_logs())
        assert res["native_links"] == 1 and res["link_transports"][0].startswith("ucx"), res
    assert c.log("server0").count("refused a direct link (ucx)") == 4, c.log("server0")
    assert "direct links: ucx (BYTEPS_TRANSPORT=ucx; UCX 1." in c.log("worker0.0"), c.log("worker0.0")


# ------------------------------------------------------------------------------ faults

FAULT_ENVS = {"tcp": dict(UCX_ENV, UCX_TLS="tcp"),
              "sm": dict(UCX_ENV, UCX_TLS="sm,self,tcp", BYTEPS_UCX_PEER_ERRORS="0")}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tls", sorted(FAULT_ENVS))
def test_killed_server_over_ucx_is_named_by_every_survivor(cluster, tls):
    """A server killed while workers push over UCX: each worker fails with PeerLostError naming it
    (nothing hangs on the dead endpoint), the other server and the scheduler exit."""
    c = cluster(2, 2, env=FAULT_ENVS[tls])
    c.run_workers("loop", {"sleep": 0.01})
    _wait_progress(c, [0, 1])
    killed_at = time.monotonic()
    c.servers[0].send_signal(signal.SIGKILL)
    codes = c.wait_workers(timeout=30)
    assert codes == [0, 0], c.all_logs()  # the scenario catches the error and reports it
    assert time.monotonic() - killed_at < 15
    res = c.results()
    for rank in (0, 1):
        err = res[rank]["value"]
        assert err["error_type"] == "PeerLostError" and "lost server" in err["error"], err
        assert res[rank]["link_transports"][1].startswith("ucx"), res[rank]  # the survivor's link
    c.servers[1].wait(15)
    c.scheduler.wait(15)
    assert c.servers[1].returncode == 1 and c.scheduler.returncode == 1, c.all_logs()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tls", sorted(FAULT_ENVS))
def test_killed_worker_over_ucx_is_named_by_every_survivor(cluster, tls):
    res = kill_a_worker(cluster(2, 1, env=FAULT_ENVS[tls]))
    assert res["link_transports"][0].startswith("ucx"), res


def test_ucx_gets_one_megabyte_tcp_segments_unless_the_user_set_them(monkeypatch):
    """Choosing UCX sets byteps' default tcp segment size for UCX to read (core/ucx.py), and without an
    RDMA device eager messages up to 1 MB; a user's value stays, and choosing TCP sets nothing."""
    ours = dict(ucx.TCP_SEGMENTS, **ucx.TCP_ONLY)
    for name in ours:  # set first, so that monkeypatch restores the original (absent) state after
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    assert ucx.choose("tcp", _worker_core) == "tcp"
    assert not any(name in os.environ for name in ours)
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "64k")
    assert ucx.choose("ucx", _worker_core) == "ucx"  # this machine has no RDMA device
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == "1m" and os.environ["UCX_TCP_RX_SEG_SIZE"] == "64k"
    assert os.environ["UCX_RNDV_THRESH"] == "1m"


def test_ucx_keeps_its_rendezvous_threshold_where_an_rdma_device_exists(monkeypatch):
    """With an RDMA device, rendezvous is verbs' zero-copy read: byteps leaves UCX's threshold alone."""
    for name in dict(ucx.TCP_SEGMENTS, **ucx.TCP_ONLY):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setattr(ucx, "_rdma_devices", lambda: ["mlx5_0 (recorded)"])
    assert ucx.choose("ucx", _worker_core) == "ucx"
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == "1m" and "UCX_RNDV_THRESH" not in os.environ


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["alone", "late-peer", "beside-async"])
def test_synchronous_calls_take_the_ucp_worker_on_the_callers_thread(cluster, case):
    """A synchronous 4 KB call over a UCX link runs its round trip on the caller's thread, which takes
    the whole UCP worker while byteps-net sleeps (submit_direct; as tests/test_links.py checks over TCP).
    ``late-peer``: a peer that comes late makes callers hand their partition to byteps-net, whose
    reply then comes through byteps-net's progress; ``beside-async``: a second thread's async push_pulls
    run on the same worker, so replies for others come in during direct calls and must reach
    byteps-net. Every result exact."""
    from test_links import run_direct_case

    results = run_direct_case(cluster, case, dict(UCX_ENV, UCX_TLS="tcp"))
    for res in results.values():
        v = res["value"]
        assert all(t.startswith("ucx") for t in res["link_transports"]), res["link_transports"]
        if case == "alone":  # nothing else in flight: nearly every call takes the fast path
            assert v["direct"] >= 300, v
        elif case == "late-peer":
            assert v["direct"] > 0, v
    if case == "late-peer":  # rank 0 waited out its window for rank 1 at least once, and handed over
        assert results[0]["value"]["adopted"] > 0, results[0]["value"]
