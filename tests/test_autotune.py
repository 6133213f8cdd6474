"""Partition size and credit from the link (byteps/autotune.py): the model, the environment's
overrides, the probe's arithmetic, and the servers' PROBE echo over an authenticated connection."""
import math
import os
import sys
import time

import pytest
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from conftest import server_data_port  # noqa: E402
from byteps import autotune  # noqa: E402
from byteps.core import auth, wire  # noqa: E402
from byteps.errors import ConfigError  # noqa: E402

GBIT = 1e9 / 8


def choose(*args, **kwargs):
    return autotune.choose(*args, **kwargs)


@pytest.mark.parametrize("bw,rtt,servers,local", [
    (2e9, 60e-6, 1, 1.0), (GBIT, 200e-6, 4, 0.25), (GBIT, 200e-6, 8, 0.0), (25 * GBIT, 50e-6, 8, 0.0),
    (100 * GBIT, 20e-6, 16, 0.0), (GBIT / 100, 1e-3, 2, 0.0), (10 * GBIT, 0.1, 4, 0.0)])
def test_choice_is_a_bounded_power_of_two_with_a_reason(bw, rtt, servers, local):
    part, credit, why = choose(bw, rtt, servers, local)
    assert autotune.MIN_PARTITION <= part <= autotune.MAX_PARTITION
    assert part & (part - 1) == 0, part
    assert autotune.MIN_CREDIT <= credit <= autotune.MAX_CREDIT
    assert "credit" in why and "Gbit/s" in why


def test_slow_links_get_small_partitions_fast_links_large_ones():
    """The emulated cluster (200 Mbit/s, n = 4, k = 0..4): 256-512 KB, where docs/benchmarks.md measured
    1.07x t_opt (4 MB: 1.36x); 1 Gbit/s: under the old 4 MB; 25 Gbit/s: megabytes, as in BytePS."""
    from byteps import placement

    for k in range(5):
        part = autotune.for_plan(placement.plan(4, k, 46_800_000, 25e6), 200e-6)[0]
        assert 256 << 10 <= part <= 512 << 10, (k, part)
    for servers in (4, 6, 8):
        assert choose(GBIT, 200e-6, servers)[0] <= 2 << 20
    assert choose(25 * GBIT, 50e-6, 8)[0] >= 4 << 20
    sizes = [choose(b * GBIT, 100e-6, 4)[0] for b in (0.1, 1, 10, 25, 100)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_smaller_steps_get_smaller_partitions():
    """Fill and drain cost about FILL_DRAIN partitions per step: a small model wants small ones."""
    sizes = [choose(25 * GBIT, 50e-6, 4, piece_cost_s=autotune.PIECE_COST_NATIVE, model_bytes=m)[0]
             for m in (8 << 20, 64 << 20, 512 << 20, 4 << 30)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    part = choose(25 * GBIT, 50e-6, 4, piece_cost_s=autotune.PIECE_COST_NATIVE, model_bytes=96 << 20)[0]
    assert autotune.FILL_DRAIN * part / (96 << 20) <= autotune.OVERHEAD * math.sqrt(2)  # within the rounding


def test_upper_bound_is_not_exceeded_by_rounding():
    """The upper bound rounds down to a power of two: at 1 Gbit/s with a third of the bytes local (n = 3,
    k = 0), the 10 ms bound is 1.875 MB; the nearest power of two, 2 MB, measured slower on the emulated
    cluster (96 MiB steps) than 1 MB."""
    b_eff = autotune.effective_bandwidth(GBIT, 1 / 3)
    part = choose(GBIT, 200e-6, 3, 1 / 3, piece_cost_s=autotune.PIECE_COST_NATIVE)[0]
    assert part == 1 << 20 and part <= autotune.GRANULARITY_S * b_eff < 2 << 20
    for m in (8 << 20, 96 << 20, 512 << 20, 4 << 30):  # never over the fill-and-drain bound when it binds
        p = choose(25 * GBIT, 50e-6, 4, piece_cost_s=autotune.PIECE_COST_NATIVE, model_bytes=m)[0]
        p_min = 4 * autotune.PIECE_COST_NATIVE * 25 * GBIT / autotune.OVERHEAD
        if autotune.OVERHEAD * m / autotune.FILL_DRAIN >= p_min:
            assert autotune.FILL_DRAIN * p / m <= autotune.OVERHEAD, (m, p)


def test_fixed_cost_bound():
    """Each piece's fixed cost stays a small part of the partition's wire time: more servers (more
    pieces per partition) or a costlier engine never get smaller partitions."""
    for bw in (GBIT, 10 * GBIT, 25 * GBIT):
        by_servers = [choose(bw, 100e-6, s)[0] for s in (1, 2, 4, 8, 16, 32)]
        assert by_servers == sorted(by_servers)
        native = choose(bw, 100e-6, 8, piece_cost_s=autotune.PIECE_COST_NATIVE)[0]
        python = choose(bw, 100e-6, 8, piece_cost_s=autotune.PIECE_COST_LOCAL_REDUCE)[0]
        assert native <= python
    # where the fixed-cost bound binds, the wire time is >= ~1/OVERHEAD pieces' cost (within the
    # power-of-two rounding: a factor sqrt(2))
    part = choose(25 * GBIT, 50e-6, 8)[0]
    wire_time = part / (25 * GBIT)
    assert wire_time >= 8 * autotune.PIECE_COST_LOCAL_REDUCE / autotune.OVERHEAD / math.sqrt(2)


def test_local_bytes_take_no_nic_time():
    """Bytes for a colocated server go through shared memory: the NIC carries less of each
    partition, so partitions may be larger for the same wire time."""
    assert choose(GBIT, 200e-6, 4, 0.5)[0] >= choose(GBIT, 200e-6, 4, 0.0)[0]
    assert choose(GBIT, 200e-6, 1, 1.0)[0] == choose(GBIT, 200e-6, 1, 1.0)[0]  # deterministic


def test_credit_covers_the_bandwidth_delay_product():
    assert choose(GBIT, 100e-6, 4)[1] == autotune.MIN_CREDIT  # LAN: far below one partition
    part, credit, _ = choose(10 * GBIT, 20e-3, 4)  # a long fat pipe
    assert (credit - autotune.MIN_CREDIT) * part >= 0.5 * 10 * GBIT * 20e-3
    assert choose(100 * GBIT, 1.0, 4)[1] == autotune.MAX_CREDIT
    credits = [choose(10 * GBIT, rtt, 4)[1] for rtt in (1e-5, 1e-3, 1e-2, 1e-1)]
    assert credits == sorted(credits)


@pytest.mark.parametrize("args", [(0, 1e-4, 1), (-1, 1e-4, 1), (GBIT, -1, 1), (GBIT, 1e-4, 0),
                                  (GBIT, 1e-4, 2, 1.5)])
def test_bad_inputs(args):
    with pytest.raises(ValueError):
        choose(*args)


def test_environment_overrides_each_choice():
    model = choose(GBIT, 200e-6, 4)
    assert autotune.resolve(model, {}) == model
    got = autotune.resolve(model, {"BYTEPS_PARTITION_BYTES": "4096000"})
    assert (got.partition_bytes, got.credit) == (4096000, model.credit)
    assert "BYTEPS_PARTITION_BYTES=4096000 overrides" in got.reason
    got = autotune.resolve(model, {"BYTEPS_SCHEDULING_CREDIT": "0"})
    assert (got.partition_bytes, got.credit) == (model.partition_bytes, 0)
    got = autotune.resolve(model, {"BYTEPS_PARTITION_BYTES": " 65536 ", "BYTEPS_SCHEDULING_CREDIT": "9"})
    assert (got.partition_bytes, got.credit) == (65536, 9)
    assert autotune.resolve(model, {"BYTEPS_PARTITION_BYTES": ""}) == model  # empty means unset
    nothing = autotune.resolve(None, {})
    assert (nothing.partition_bytes, nothing.credit) == (autotune.DEFAULT_PARTITION, autotune.DEFAULT_CREDIT)


@pytest.mark.parametrize("env", [{"BYTEPS_PARTITION_BYTES": "32"}, {"BYTEPS_PARTITION_BYTES": "4MB"},
                                 {"BYTEPS_SCHEDULING_CREDIT": "-1"}])
def test_malformed_overrides_are_config_errors(env):
    with pytest.raises(ConfigError, match=next(iter(env))):
        autotune.resolve(choose(GBIT, 1e-4, 2), env)


def test_probe_arithmetic_on_a_simulated_link():
    """rtt 150 us, 1 Gbit/s each way, noise that only ever slows an echo: the fastest echoes give
    the link back."""
    now = [0.0]
    noise = iter([3e-4, 0.0, 1e-3, 2e-5, 0.0] * 10)

    def clock():
        return now[0]

    def send_recv(payload):
        now[0] += 150e-6 + 2 * len(payload) / GBIT + next(noise)
        return payload

    m = autotune.probe(send_recv, sizes=(64, 1 << 20), repeats=5, clock=clock)
    assert m.rtt_s == pytest.approx(150e-6 + 128 / GBIT)
    assert m.bandwidth_Bps == pytest.approx(GBIT, rel=1e-6)
    assert len(m.samples[64]) == len(m.samples[1 << 20]) == 5


def test_probe_refuses_echoes_that_timed_the_load():
    """The small echoes waited behind other processes, so the fastest 1 MiB echo came back 1 us after
    the fastest small one: that is no link (it would be 2 TB/s, and gave one worker 64 MB partitions
    and credit 64). The probe tries a second round, then fails; the engine then proposes nothing
    (agree() gives it the job's median link). A round spoilt once is measured again."""
    now = [0.0]

    def clock():
        return now[0]

    def send_recv(payload):
        now[0] += 400e-6 if len(payload) < 1000 else 401e-6
        return payload

    with pytest.raises(ValueError, match="2 times: that timed this machine's load, not the link"):
        autotune.probe(send_recv, sizes=(64, 1 << 20), repeats=3, clock=clock)

    calls = [0]

    def load_then_link(payload):  # 10 GB/s; the first round's small echoes wait 300 us behind other work
        calls[0] += 1
        now[0] += 100e-6 + 2 * len(payload) / 10e9 + (300e-6 if calls[0] <= 6 and len(payload) < 1000 else 0)
        return payload

    m = autotune.probe(load_then_link, sizes=(64, 1 << 20), repeats=3, clock=clock)
    assert calls[0] == 12 and m.bandwidth_Bps == pytest.approx(10e9, rel=1e-6)

    def fast_link(payload):  # 50 GB/s each way: fast, but a link
        now[0] += 100e-6 + 2 * len(payload) / 50e9
        return payload

    m = autotune.probe(fast_link, sizes=(64, 1 << 20), repeats=3, clock=clock)
    assert m.bandwidth_Bps == pytest.approx(50e9, rel=1e-6)


def test_probe_rejects_a_wrong_echo():
    with pytest.raises(ValueError, match="echo"):
        autotune.probe(lambda p: p[:-1], sizes=(64, 4096))
    with pytest.raises(ValueError):
        autotune.probe(lambda p: p, sizes=(64,))


def _knock(sock, secret):
    knock = auth.Knock(secret, sock.getsockopt(zmq.IDENTITY))
    sock.send_multipart(wire.control(wire.Cmd.HELLO, 0, knock.hello()))
    assert sock.poll(10000), "no CHALLENGE"
    header, body = sock.recv_multipart()
    assert wire.unpack(header).cmd == wire.Cmd.CHALLENGE
    sock.send_multipart(wire.control(wire.Cmd.AUTH, 0, {"mac": knock.answer(wire.decode(body), "server 0")}))


@pytest.mark.timeout(90)
def test_server_echoes_probe_to_authenticated_peers_only(cluster):
    c = cluster(2, 1)
    # the server's native core owns its data socket from the address book on: a worker that has
    # pushed once (and then waits for OUTDIR/go) shows the job has started
    c.run_workers("wait_then_sum", {"wait": 80})
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(c.tmp, f"progress.{r}")) for r in (0, 1)):
        assert time.monotonic() < deadline, c.all_logs()
        time.sleep(0.05)
    port = server_data_port(c.servers[0].pid)
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.DEALER)
        stranger.connect(f"tcp://127.0.0.1:{port}")
        stranger.send_multipart([wire.pack(wire.Cmd.PROBE, length=5), b"hello"])
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, auth.new_identity())
        sock.connect(f"tcp://127.0.0.1:{port}")
        _knock(sock, auth.job_secret(c.env))
        echo = autotune.zmq_echo(sock, timeout_s=10)
        for size in (0, 1, 4096, 100_000, 1 << 20):  # small ones copied, large ones zero-copy
            payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
            assert bytes(echo(payload)) == payload
        m = autotune.probe(echo, sizes=(64, 256 << 10), repeats=3)
        assert 0 < m.rtt_s < 1 and m.bandwidth_Bps > 1e6
        part, credit, why = autotune.choose(m.bandwidth_Bps, m.rtt_s, 1, 1.0)
        assert part >= autotune.MIN_PARTITION and credit >= autotune.MIN_CREDIT, why
        assert stranger.poll(300) == 0, "the server echoed a peer that never authenticated"
    finally:
        ctx.destroy(linger=0)
        open(os.path.join(c.tmp, "go"), "w").close()
    codes, _, _ = c.wait_all(60)
    assert codes == [0, 0], c.all_logs()
    assert "ignored data from an unauthenticated peer" in c.log("server0"), c.log("server0")


def test_bpslaunch_plan_prints_the_choice(capsys):
    from byteps import launcher

    assert launcher.main(["--plan", "--worker-machines", "4", "--extra", "2", "--bandwidth", "1Gbit",
                          "--latency", "200us"]) == 0
    out = capsys.readouterr().out
    assert "t_opt" in out  # the placement table is still there
    want = autotune.choose(GBIT, 200e-6, 6, 2 / 20)
    assert f"partition {autotune._human(want.partition_bytes)} ({want.partition_bytes} bytes), credit {want.credit}" in out
    assert "native core" in out and "BYTEPS_PARTITION_BYTES" in out
    assert launcher.main(["--plan", "--worker-machines", "2", "--latency", "soon"]) == 2
    assert "cannot read a duration" in capsys.readouterr().err


@pytest.mark.parametrize("text,seconds", [("200us", 200e-6), ("0.5ms", 5e-4), ("2s", 2.0), ("1e-4", 1e-4),
                                          ("0", 0.0)])
def test_parse_duration(text, seconds):
    assert autotune.parse_duration(text) == pytest.approx(seconds)


# ------------------------------------------------------------------ the job-wide agreement (engine)

def _prop(partition, source="probe", bw=25e6, rtt=200e-6, worker_id=0):
    return {"partition": partition, "source": source, "bw": bw, "rtt": rtt, "worker_id": worker_id}


def test_agree_takes_the_median_proposal_on_every_rank():
    props = {"0": _prop(256 << 10, worker_id=0), "1": _prop(4 << 20, bw=2e9, worker_id=1),
             "2": _prop(1 << 20, bw=125e6, rtt=0.05, worker_id=2)}
    got = [autotune.agree(props, r, (2, 0.0, 0), env={}) for r in range(3)]
    assert {g.partition_bytes for g in got} == {1 << 20} and {g.source for g in got} == {"probe"}
    assert "at rank 2" in got[0].text and "median of 3" in got[0].text
    # each rank's credit is its own link's: rank 2's 50 ms round trip holds ~6 partitions more
    assert [g.credit for g in got] == [4, 4, 4 + round(125e6 * 0.05 / (1 << 20))]
    even = {"0": _prop(256 << 10), "1": _prop(4 << 20)}
    assert autotune.agree(even, 1, (2, 0.0, 0), env={}).partition_bytes == 256 << 10  # the lower median


def test_agree_env_wins_and_differing_values_are_named():
    props = {"0": _prop(65536, source="env"), "1": _prop(4 << 20), "2": _prop(512 << 10)}
    got = autotune.agree(props, 1, (2, 0.0, 0), env={})
    assert (got.partition_bytes, got.source) == (65536, "env")
    assert "BYTEPS_PARTITION_BYTES" in got.text and "ranks [1, 2] without it" in got.text
    props["2"] = _prop(4096, source="env")
    with pytest.raises(ConfigError, match=r"differs across workers .*: rank 0: 65536, rank 2: 4096"):
        autotune.agree(props, 0, (2, 0.0, 0), env={})


def test_agree_without_measurements_and_credit_sources():
    nothing = {"0": {"partition": None, "source": "none", "worker_id": 0},
               "1": {"partition": None, "source": "none", "worker_id": 1}}
    got = autotune.agree(nothing, 0, (1, 0.0, 0), env={})
    assert (got.partition_bytes, got.credit, got.source) == (autotune.DEFAULT_PARTITION, autotune.DEFAULT_CREDIT,
                                                              "default")
    # local rank 1 of machine 0 did not probe: its credit comes from its machine's measurement (rank 0)
    props = {"0": _prop(256 << 10, rtt=0.1, worker_id=0), "1": {"partition": None, "source": "none", "worker_id": 0},
             "2": _prop(256 << 10, rtt=1e-4, worker_id=1)}
    assert autotune.agree(props, 1, (2, 0.0, 0), env={}).credit == autotune.agree(props, 0, (2, 0.0, 0), env={}).credit > 4
    assert autotune.agree(props, 1, (2, 0.0, 0), env={"BYTEPS_SCHEDULING_CREDIT": "7"}).credit == 7


def test_propose_and_probe_target():
    m = autotune.Measurement(200e-6, 25e6, {})
    p = autotune.propose(m, (4, 0.25, 0), env={})
    assert p["source"] == "probe" and p["partition"] == autotune.choose(25e6, 200e-6, 4, 0.25).partition_bytes
    assert autotune.propose(m, (4, 0.25, 0), env={"BYTEPS_PARTITION_BYTES": "1000"})["partition"] == 1000
    assert autotune.propose(None, (4, 0.25, 0), env={})["source"] == "none"
    # the placement's cut bound: never a partition too small to be cut over every server
    assert autotune.propose(m, (4, 0.25, 360448), env={})["partition"] == 512 << 10
    servers = [{"host": h} for h in ("a", "b", "c", "a")]
    assert autotune.job_shape(servers, [1, 1, 2, 0], "a", 65536) == (3, 0.25, 65536)
    assert [autotune.probe_target(servers, [1, 1, 1, 1], "a", r) for r in range(3)] == [1, 2, 1]
    assert autotune.probe_target(servers, [1, 0, 0, 1], "a", 1) == 3  # every server local: a local one
    assert autotune.test_link({"BYTEPS_TEST_LINK": "25e6,0.001"}) == autotune.Measurement(0.001, 25e6, {})
    with pytest.raises(ConfigError, match="BYTEPS_TEST_LINK"):
        autotune.test_link({"BYTEPS_TEST_LINK": "fast"})


def _tuned(c):
    codes = c.wait_workers(90)
    assert codes == [0] * len(codes), f"worker exit codes {codes}\n{c.all_logs()}"
    res = c.results()
    assert all("error" not in r for r in res.values()), c.all_logs()
    return [res[r]["value"] for r in sorted(res)]


def _expected_sum(n, numel=300_000):
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib
    from scenarios import seeded

    return sum(seeded(r, (numel,), torch.float32) for r in range(n)).tolist()[:8]


@pytest.mark.timeout(120)
def test_job_probes_and_every_worker_uses_one_partition_size(cluster):
    """No variable set: each worker probes a server at start, the scheduler hands every proposal to
    all, and all use the same size: in the config, the placement, the fusion default and the wire."""
    c = cluster(2, 2, env={"BYTEPS_LOG_LEVEL": "INFO"})
    c.env.pop("BYTEPS_PARTITION_BYTES", None)
    c.env.pop("BYTEPS_SCHEDULING_CREDIT", None)
    c.run_workers("tuned")
    vals = _tuned(c)
    sizes = {v["tuning"]["partition_bytes"] for v in vals}
    assert len(sizes) == 1 and {v["tuning"]["source"] for v in vals} == {"probe"}, vals
    for v in vals:
        t = v["tuning"]
        assert v["config_partition"] == v["placement_partition"] == t["partition_bytes"]
        assert v["native_pieces"] == [v["pieces"]], v  # what the native core sends is cut alike
        assert v["config_credit"] == t["credit"] and v["queue_credit"] == t["credit"] * t["partition_bytes"]
        assert t["bandwidth_Bps"] > 1e6 and 0 < t["rtt_s"] < 0.1
        # what the probe and the agreement add to init() on loopback: a few ms on a quiet machine; the
        # bound leaves room for a loaded CI machine and still fails a probe that spends its budget
        assert t["took_s"] < 1.5, t
        assert v["sum"] == pytest.approx(_expected_sum(2), rel=1e-6)
    for w in ("worker0.0", "worker1.0"):
        line = [ln for ln in c.log(w).splitlines() if "INFO partition size" in ln]
        assert len(line) == 1 and "probed:" in line[0] and "credit" in line[0], c.log(w)


@pytest.mark.timeout(120)
def test_workers_that_measure_differently_still_agree(cluster):
    """The test hook gives each worker a different link: their proposals differ (256 KB, 4 MB,
    1 MB), every one uses the median, and each keeps a credit of its own link."""
    c = cluster(3, 2)
    links = {0: "25e6,1e-4", 1: "2e9,5e-5", 2: "125e6,0.05"}
    for wid, link in links.items():
        c.run_workers("tuned", machines=[wid], env={"BYTEPS_TEST_LINK": link})
    vals = _tuned(c)
    assert {v["tuning"]["partition_bytes"] for v in vals} == {1 << 20}, [v["tuning"]["text"] for v in vals]
    assert [v["tuning"]["credit"] for v in vals] == [4, 4, 4 + round(125e6 * 0.05 / (1 << 20))]
    assert "[262144, 1048576, 4194304]" in vals[0]["tuning"]["text"]
    for v in vals:
        assert v["sum"] == pytest.approx(_expected_sum(3), rel=1e-6)
        # 1.2 MB in 1 MB partitions: two of them, in the placement and in the native core's table
        assert v["pieces"] == 4 and v["native_pieces"] == [4], v


@pytest.mark.timeout(120)
def test_partition_bytes_variable_wins_job_wide(cluster):
    """BYTEPS_PARTITION_BYTES and BYTEPS_SCHEDULING_CREDIT set: nothing is probed and they are used;
    set on one worker only, the others take its value rather than cut tensors differently."""
    c = cluster(2, 2, env={"BYTEPS_PARTITION_BYTES": "65536", "BYTEPS_SCHEDULING_CREDIT": "3"})
    c.run_workers("tuned")
    for v in _tuned(c):
        t = v["tuning"]
        assert (t["partition_bytes"], t["credit"], t["source"]) == (65536, 3, "env")
        assert t["bandwidth_Bps"] is None  # both set: no probe
        assert v["config_partition"] == v["placement_partition"] == 65536 and v["pieces"] >= 19
    c2 = cluster(2, 2, subdir="one")
    c2.run_workers("tuned", machines=[0], env={"BYTEPS_PARTITION_BYTES": "100000"})
    c2.run_workers("tuned", machines=[1])
    vals = _tuned(c2)
    assert [v["tuning"]["partition_bytes"] for v in vals] == [100000, 100000]
    assert "ranks [1] without it use it too" in vals[1]["tuning"]["text"]
    assert vals[1]["tuning"]["source"] == "env" and vals[1]["tuning"]["bandwidth_Bps"] > 0  # rank 1 probed
    for v in vals:
        assert v["sum"] == pytest.approx(_expected_sum(2), rel=1e-6)


@pytest.mark.timeout(120)
def test_differing_partition_variables_fail_at_init_naming_the_ranks(cluster):
    c = cluster(2, 1)
    c.run_workers("tuned", machines=[0], env={"BYTEPS_PARTITION_BYTES": "65536"})
    c.run_workers("tuned", machines=[1], env={"BYTEPS_PARTITION_BYTES": "4096"})
    codes = c.wait_workers(60)
    assert codes[0] != 0 and codes[1] != 0, c.all_logs()
    for w in ("worker0.0", "worker1.0"):
        assert "BYTEPS_PARTITION_BYTES differs across workers" in c.log(w) and "rank 1: 4096" in c.log(w), c.log(w)


def test_balanced_partitions_are_never_too_small_to_cut():
    """The cut bound: on the emulated cluster at k = 3 the colocated servers' share is 1/22, so a
    partition under 352 KB is not cut over the servers (it went whole, hashed, at 2.21x t_opt);
    the choice is the next power of two above it, as the engine's Placement.min_cut says."""
    from byteps import placement

    for n, k in [(4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (8, 7), (2, 1)]:
        plan = placement.plan(n, k, 46_800_000, 25e6)
        part = autotune.for_plan(plan, 200e-6)[0]
        book = {"workers": [{"host": f"w{i}"} for i in range(n)],
                "servers": [{"host": f"w{i}"} for i in range(n)] + [{"host": f"x{j}"} for j in range(k)]}
        cut = placement.Placement.from_book(book).min_cut
        assert part >= cut, (n, k, part, cut)
    assert autotune.choose(25e6, 2e-4, 7, 1 / 22, min_cut_bytes=360448)[0] == 512 << 10
    assert autotune.choose(25e6, 2e-4, 7, 1 / 22, placement="hash", min_cut_bytes=360448)[0] == 256 << 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compressor", ["fp16", "none"], ids=["python-queue", "native-queue"])
def test_urgent_tensor_past_a_full_credit_does_not_deadlock(cluster, compressor):
    """Small partitions (as probed on slow links) and a full credit: the most urgent tensor goes out
    past the credit piece by piece on every worker, so every worker must send a partition's pieces in
    the same order, or each server waits for a piece another worker's credit holds back (seen on
    the emulated cluster: bench_users.py --cluster hung with 1 MB partitions at 1 Gbit/s)."""
    c = cluster(2, 2, env={"BYTEPS_PARTITION_BYTES": "65536", "BYTEPS_SCHEDULING_CREDIT": "1",
                           "BYTEPS_TIMEOUT": "10", "BYTEPS_COMPRESSOR": compressor, "BYTEPS_ENABLE_IPC": "0"})
    c.run_workers("credit_crossing")
    for v in _tuned(c):
        assert v["errors"] == [] and v["exact"], v


@pytest.mark.timeout(120)
def test_local_ranks_share_their_machines_probe(cluster):
    """Under local reduce one copy per machine crosses its NIC: only local rank 0 probes, and its
    machine's other processes take the job's size and a credit from that measurement."""
    c = cluster(2, 1, local_size=2)
    c.run_workers("tuned")
    vals = _tuned(c)
    assert len(vals) == 4 and len({v["tuning"]["partition_bytes"] for v in vals}) == 1
    assert "median of 2 worker(s)" in vals[0]["tuning"]["text"]  # two machines, two probes
    for v in vals:
        assert v["tuning"]["source"] == "probe" and v["tuning"]["bandwidth_Bps"] > 0
        assert v["sum"] == pytest.approx(_expected_sum(4), rel=1e-6)


@pytest.mark.timeout(120)
def test_an_optimizer_chooses_the_partition_size_for_its_model(cluster):
    """init() chose 512 KB partitions for a 500 Mbit/s link, not knowing the model; a DistributedOptimizer
    of a 2.4 MB model tells the engine, and every worker, from the same proposals, cuts the gradients
    into 64 KB partitions with a credit to match. A tensor cut before keeps its partitions; a later, smaller
    model changes nothing; every sum is exact."""
    c = cluster(2, 2, env={"BYTEPS_LOG_LEVEL": "INFO", "BYTEPS_TEST_LINK": "62.5e6,0.0005"})
    c.env.pop("BYTEPS_PARTITION_BYTES", None)
    c.env.pop("BYTEPS_SCHEDULING_CREDIT", None)
    c.run_workers("tuned_for_model")
    vals = _tuned(c)
    for v in vals:
        assert v["before"]["partition_bytes"] == 512 << 10 and v["before"]["credit_bytes"] == 4 * (512 << 10), v
        assert v["partition_bytes"] == v["after"]["partition_bytes"] == 64 << 10, v["after"]["text"]
        assert v["credit_bytes"] == v["after"]["credit"] * (64 << 10)
        assert "for a model of 2.41 MB" in v["after"]["text"], v["after"]["text"]
        # the largest gradient (2.4 MB) in 64 KB partitions of one piece per server; "early" as before
        assert v["grad_pieces"] == [2 * 37] and v["early_pieces"] == [2 * 3], v
        assert v["early"] == pytest.approx(_expected_sum(2), rel=1e-6)
        for numel, got in zip((600_000, 1000, 30_000), v["grads"]):
            want = [(i % 7) * 1.5 for i in range(min(numel, 20))]  # the average of 1x and 2x
            assert got == want
    for w in ("worker0.0", "worker1.0"):
        assert "tensors first used from now on" in c.log(w), c.log(w)
