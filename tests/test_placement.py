"""The k/n workload split (byteps/placement.py): Eq. 1-7 of the BytePS paper, its edge cases, and the
placements the engine uses (identical on every worker, stable, balanced within one unit)."""
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from byteps import placement
from byteps.placement import ALIGN, MIN_PIECE, Placement


def book(worker_hosts, server_hosts, roles=None):
    """An address book as the scheduler sends it (only the fields placement reads)."""
    return {"workers": [{"host": h, "rank": r} for r, h in enumerate(worker_hosts)],
            "servers": [{"host": h, "ss_role": (roles or {}).get(i, "auto")} for i, h in enumerate(server_hosts)]}


def paper_book(n, k):
    """n worker machines each with a colocated server, k extra machines each with a standalone one."""
    return book([f"10.0.0.{i}" for i in range(n)],
                [f"10.0.0.{i}" for i in range(n)] + [f"10.0.1.{j}" for j in range(k)])


# ------------------------------------------------------------------------------------ Eq. 1-7

@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("k", range(0, 12))
def test_shares_sum_to_the_model(n, k):
    cpu, gpu = placement.shares(n, k)
    assert k * cpu + n * gpu == 1  # Eq. 5, exactly (Fractions)
    assert cpu >= 0 and gpu >= 0
    if 1 <= k <= n and n >= 2:  # the paper's formulas verbatim
        d = n * n + k * n - 2 * k
        assert (cpu, gpu) == (Fraction(2 * (n - 1), d), Fraction(n - k, d))


@pytest.mark.parametrize("n,k", [(n, k) for n in range(2, 9) for k in range(0, n + 1)])
def test_shares_equalise_machine_times(n, k):
    """Theorem 1: with Eq. 1-2 a worker machine (Eq. 3) and an extra machine move the same bytes."""
    cpu, gpu = placement.shares(n, k)
    worker = 1 + (n - 2) * gpu          # M + (n-2) M_gpu, per direction
    if k:
        assert n * cpu == worker        # an extra machine talks to each of the n workers
    p = placement.plan(n, k, 10 ** 9, bandwidth=1e9)
    assert p.t_opt == pytest.approx(float(worker))  # Eq. 6 = Eq. 3 at the optimum, in M/B units


def test_paper_example_n32_k16():
    ga, gp = placement.gammas(32, 16)
    # the paper prints 1.46 and 1.52 (1504/1024 = 1.46875 and 1504/992 = 1.516...)
    assert ga == pytest.approx(1504 / 1024) and math.floor(ga * 100) / 100 == 1.46
    assert gp == pytest.approx(1504 / 992) and round(gp, 2) == 1.52


def test_gammas_are_the_ratios_of_table_1_times():
    for n in range(2, 9):
        for k in range(1, n + 1):
            t_opt, t_ar, t_ps = placement.times(n, k, 1e9, 1e8)
            ga, gp = placement.gammas(n, k)
            assert t_ar / t_opt == pytest.approx(ga) and t_ps / t_opt == pytest.approx(gp)


def test_edge_cases():
    # k = 0: colocated PS = all-reduce time, every server 1/n, no plain PS to compare with
    p = placement.plan(4, 0, 1000, 1e3)
    assert p.colocated_share == 0.25 and p.standalone_share == 0 and p.t_plain_ps is None
    assert p.t_opt == pytest.approx(p.t_allreduce) and p.gamma_a == 1 and p.gamma_p is None
    # k = n: plain PS; colocated servers get nothing, γ_p = 1, t = M/B
    p = placement.plan(4, 4, 1000, 1e3)
    assert p.colocated_share == 0 and p.standalone_share == 0.25 and p.t_opt == pytest.approx(1.0)
    assert p.gamma_p == pytest.approx(1.0) and p.gamma_a == pytest.approx(24 / 16)
    # k > n: more extra machines do not help; they split the model evenly
    p = placement.plan(4, 6, 1200, 1e3)
    assert p.standalone_share == pytest.approx(1 / 6) and p.colocated_share == 0
    assert p.t_opt == pytest.approx(1.2) and p.gamma_p == 1.0
    assert [h.tx_bytes for h in p.hosts] == [1200] * 4 + [800] * 6
    # n = 1: the lone worker's own server sums everything, nothing crosses the network
    for k in (0, 1, 3):
        p = placement.plan(1, k, 1000, 1e3)
        assert p.colocated_share == 1 and p.standalone_share == 0 and p.t_opt == 0
        assert all(h.tx_bytes == 0 for h in p.hosts)
    with pytest.raises(ValueError):
        placement.shares(0, 1)


def test_plan_traffic_and_bytes():
    p = placement.plan(4, 2, 20_000_000, placement.parse_rate("100Mbit"))
    assert p.bandwidth == 12.5e6
    assert [s.bytes for s in p.servers] == [2_000_000] * 4 + [6_000_000] * 2  # 2/20 and 6/20
    assert sum(s.bytes for s in p.servers) == 20_000_000
    assert [h.tx_bytes for h in p.hosts] == [24_000_000] * 4 + [24_000_000] * 2  # all equal: optimal
    assert p.t_opt == pytest.approx(24e6 / 12.5e6)
    text = p.table()
    assert "t_opt" in text and "gamma_a" in text and "extra 1" in text


def test_parsers():
    assert placement.parse_rate("10Gbit") == 1.25e9
    assert placement.parse_rate("1.25GB") == 1.25e9
    assert placement.parse_bytes("64MB") == 64_000_000 and placement.parse_bytes("1MiB") == 1 << 20
    with pytest.raises(ValueError):
        placement.parse_rate("fast")


# ------------------------------------------------------------------------ the address book

def test_roles_from_hosts_and_override():
    b = book(["a", "b"], ["a", "b", "c"])
    assert placement.server_roles(b) == ["colocated", "colocated", "standalone"]
    b = book(["a", "b"], ["a", "b", "c"], roles={0: "standalone", 2: "colocated"})
    assert placement.server_roles(b) == ["standalone", "colocated", "colocated"]


@pytest.mark.parametrize("n,k", [(4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (4, 6), (2, 1), (8, 3), (1, 2)])
def test_weights_are_the_paper_slots(n, k):
    w = placement.weights_for_book(paper_book(n, k))
    cpu_w, gpu_w, total = placement.slots(n, k)
    assert w == [gpu_w] * n + [cpu_w] * k and sum(w) == total
    if 1 <= k <= n and n >= 2:
        assert total == n * n + k * n - 2 * k


def test_weights_of_books_outside_the_model():
    # everything on one host (the test clusters): equal shares
    assert placement.weights_for_book(book(["127.0.0.1"] * 3, ["127.0.0.1"] * 2)) == [1, 1]
    # two servers on one extra machine split that machine's share
    w = placement.weights_for_book(book(["a", "b", "c", "d"], ["a", "b", "c", "d", "x", "x"]))
    cpu, gpu = placement.shares(4, 1)
    assert Fraction(w[4], sum(w)) == cpu / 2 and Fraction(w[0], sum(w)) == gpu
    # worker machines without servers: plain PS on the extra machines
    assert placement.weights_for_book(book(["a", "b"], ["x", "y", "z"])) == [1, 1, 1]
    # some worker machines serve, some do not: equal time for the hosts that exist
    cpu, gpu = placement.host_shares(4, 2, 1)
    assert 2 * gpu + cpu == 1 and 4 * cpu == 1 + 2 * gpu


def test_describe_names_servers_by_their_index():
    """After an elastic change the servers' positions are not their indices: the log names the index."""
    b = book(["127.0.0.1"] * 2, ["127.0.0.1"] * 3)
    b["servers"] = [dict(s, index=i) for s, i in zip(b["servers"], (0, 2, 5))]
    text = placement.Placement.from_book(b).describe()
    assert "server 0 (" in text and "server 2 (" in text and "server 5 (" in text and "server 1 (" not in text, text


def test_a_new_membership_cuts_its_partitions_by_the_shares():
    """Elastic servers: partitions of 32 KB are too small to cut over n = 3 colocated servers and k = 2
    standalone ones (shares 1/11 and 4/11: each piece would be under MIN_PIECE), so whole partitions
    spread by hash miss the shares (with 16 KB pieces and 128 KB partitions, one standalone server got
    0.47 of the bytes on the emulated cluster). The membership's placement takes the power of two at or
    above its cut bound instead, and the bytes follow Eq. 1-2."""
    from byteps.core.engine_elastic import membership_placement

    b = paper_book(3, 2)
    tensors = [4000, 1_200_000, 4_800_000, 64, 4000]  # tests/scenarios_elastic.py's step

    def shares(p):
        per = [0] * len(b["servers"])
        for tkey, n in enumerate(tensors, start=1):
            for _, _, length, server in p.partitions(tkey, n, 4):
                per[server] += length
        return [x / sum(per) for x in per]
    small = 32 << 10
    pooled = placement.Placement.from_book(b, "balanced", small)
    assert pooled.min_cut > small
    want = [Fraction(w, sum(pooled.weights)) for w in pooled.weights]
    # below min_cut the colocated servers' pieces are pooled: some partitions give one of them nothing
    assert any(0 not in got and len(got) < len(b["servers"])
               for got in pieces_by_partition(pooled, 2, 1_200_000, 4).values())
    p = membership_placement(b, "balanced", small, 0)
    assert p.partition_bytes == 64 << 10 and p.min_cut <= p.partition_bytes
    assert all(abs(got - float(w)) < 0.02 for got, w in zip(shares(p), want)), (shares(p), want)
    assert membership_placement(b, "balanced", 4 << 20, 0).partition_bytes == 4 << 20  # large enough: kept
    assert membership_placement(b, "hash", small, 0).partition_bytes == small  # hash never cuts


# ------------------------------------------------------------------------------- placements

def check_cover(parts, nbytes):
    """Partitions tile [0, nbytes) exactly, each index once."""
    spans = sorted((off, length) for _, off, length, _ in parts)
    pos = 0
    for off, length in spans:
        assert off == pos
        pos += length
    assert pos == nbytes
    assert len({i for i, *_ in parts}) == len(parts)


@pytest.mark.parametrize("mode", placement.MODES)
def test_identical_on_every_worker_and_stable(mode):
    b = paper_book(4, 2)
    planners = [Placement.from_book(b, mode, 1 << 20, rank=r) for r in range(4)]
    tensors = [(t, nb, 4) for t, nb in enumerate([4, 1000, 40000, 3 << 20, (7 << 20) + 12, 0], start=1)]
    for tkey, nbytes, size in tensors:
        plans = [sorted(p.partitions(tkey, nbytes, size)) for p in planners]
        assert all(pl == plans[0] for pl in plans), (tkey, nbytes)  # same pieces and servers
        check_cover(plans[0], nbytes)
        again = Placement.from_book(b, mode, 1 << 20, rank=2)
        assert sorted(again.partitions(tkey, nbytes, size)) == plans[0]  # stable: a pure function
        for i, _, _, s in plans[0]:
            assert planners[0].server(tkey, i) == s  # the index alone names the server (join())


def pieces_by_partition(p, tkey, nbytes, itemsize):
    out = {}
    for i, off, length, s in p.partitions(tkey, nbytes, itemsize):
        out.setdefault(i // p.num_servers, {})[s] = length
    return out


def test_balanced_pieces_within_one_unit_of_target():
    for n, k in [(4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (3, 5), (8, 3)]:
        p = Placement.from_book(paper_book(n, k), "balanced", 1 << 20)
        share = p.shares()
        for nbytes in (1 << 20, 3 << 20, (1 << 20) + 4, 5_000_004, MIN_PIECE * (n + k) + 8):
            check_cover(p.partitions(1, nbytes, 4), nbytes)
            for j, got in pieces_by_partition(p, 1, nbytes, 4).items():
                size = sum(got.values())
                if size < p.min_cut:  # a short tail: the servers whose piece reaches MIN_PIECE keep it exactly
                    assert j == nbytes // (1 << 20), (n, k, nbytes, j)
                    big = [s for s in range(p.num_servers) if size * share[s] >= MIN_PIECE]
                    for s in big:
                        assert abs(got.get(s, 0) - size * share[s]) <= ALIGN, (n, k, size, s)
                    pooled = sum(length for s, length in got.items() if s not in big)
                    assert abs(pooled - size * sum(share[s] for s in range(p.num_servers) if s not in big)) \
                        <= p.num_servers * ALIGN, (n, k, size, got)
                    continue
                for s in range(p.num_servers):
                    assert abs(got.get(s, 0) - size * share[s]) <= ALIGN, (n, k, size, s)


def test_every_fusion_buffer_is_split_within_one_unit():
    """Balanced fusion: buffers of BYTEPS_PARTITION_BYTES, each cut over all servers in the Eq. 1-2
    proportions, every server's piece of every buffer within one ALIGN unit of its target."""
    from byteps.core import dtypes
    from byteps.fusion import FusionLayout

    entries = [(f"t{i}", nb, dt) for i, (nb, dt) in enumerate(
        [(28, dtypes.FLOAT32), (4 << 20, dtypes.FLOAT32), (1000, dtypes.FLOAT16), (3_000_004, dtypes.FLOAT32),
         (123_456, dtypes.FLOAT16), (8, dtypes.INT64), (2_500_000, dtypes.FLOAT32)])]
    partition = 1 << 20
    layout = FusionLayout(entries, partition)
    assert all(nb <= partition for _, nb in layout.buffers)
    p = Placement.from_book(paper_book(4, 2), "balanced", partition)
    for b, (dt, nbytes) in enumerate(layout.buffers):
        (got,) = pieces_by_partition(p, 100 + b, nbytes, dtypes.itemsize(dt)).values()  # one partition each
        if nbytes < p.min_cut:
            continue  # the last, short buffer of a dtype: whole to one server
        for s, share in enumerate(p.shares()):
            assert abs(got.get(s, 0) - nbytes * share) <= ALIGN, (b, s)
    # every tensor's bytes are laid out exactly once
    for name, nbytes, _ in entries:
        runs = layout.runs[name]
        assert sum(r[3] for r in runs) == nbytes and [r[2] for r in runs] == sorted(r[2] for r in runs)


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 50_000_000), weights=st.lists(st.integers(0, 40), min_size=1, max_size=12),
       align=st.sampled_from([1, 8, 64]))
def test_apportion_property(nbytes, weights, align):
    if sum(weights) == 0:
        weights = weights + [1]
    lengths = placement.apportion(nbytes, weights, align)
    assert sum(lengths) == nbytes and min(lengths) >= 0
    total = sum(weights)
    for w, length in zip(weights, lengths):
        assert abs(length - nbytes * w / total) <= align
        if w == 0:
            assert length == 0
    # cuts fall on unit boundaries, so on element boundaries for every dtype
    pos = 0
    for length in lengths[:-1]:
        pos += length
        assert pos % align == 0 or pos == nbytes


def test_balanced_sends_pieces_in_one_order_on_every_rank():
    """The same piece order on every worker (a full credit lets the most urgent tensor out one piece
    at a time: rank-rotated orders deadlocked, tests/test_autotune.py), successive partitions
    starting at successive servers."""
    b = paper_book(4, 0)
    orders = {tuple(Placement.from_book(b, "balanced", 1 << 20, rank=r).partitions(9, 4 << 20, 4)) for r in range(4)}
    assert len(orders) == 1
    firsts = [parts[0][3] for parts in (Placement.from_book(b, "balanced", 1 << 20).partitions(9, 4 << 20, 4)[4 * j:]
                                        for j in range(4))]
    assert sorted(firsts) == [0, 1, 2, 3]


def test_small_partitions_pool_the_smallest_shares():
    """A partition below min_cut: servers whose exact piece would reach MIN_PIECE get it (within one
    unit); the others' bytes go in pieces of about MIN_PIECE to some of them, so each server's
    expected bytes are still its share. Whole tails on hashed servers put 1.2-1.6% more bytes on
    the busiest host of this ResNet-18 of 30 MB (n = 4, k = 3, 128 KB partitions) than Eq. 1-2."""
    n, k = 4, 3
    p = Placement.from_book(paper_book(n, k), "balanced", 128 << 10)
    share, small_share = p.shares(), Fraction(1, sum(p.weights))
    assert p.min_cut > 60_000
    totals = [0] * p.num_servers
    for tkey in range(1, 3001):
        nbytes = 60_000 + 64 * (tkey % 200)  # one partition each, below min_cut
        (got,) = pieces_by_partition(p, tkey, nbytes, 4).values()
        check_cover(p.partitions(tkey, nbytes, 4), nbytes)
        for s in range(n, n + k):  # standalone: their exact pieces
            assert abs(got[s] - nbytes * share[s]) <= ALIGN, (tkey, s, got)
        pooled = [got[s] for s in range(n) if s in got]
        assert 1 <= len(pooled) < n and min(pooled) >= 4000, (tkey, got)  # fewer, larger colocated pieces
        assert abs(sum(pooled) - nbytes * n * small_share) <= n * ALIGN, (tkey, got)
        for s, length in got.items():
            totals[s] += length
    for s in range(p.num_servers):  # each server's expected bytes: its share
        assert abs(totals[s] / sum(totals) - share[s]) < 0.002, (s, totals[s] / sum(totals), share[s])

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from emulated_cluster import model_layers  # the benchmark's model: ResNet-18's tensors scaled to 30 MB
    tensors = [(t, numel * 4, 4) for t, (_, numel) in enumerate(model_layers(30_000_001), start=1)]
    hosts = [s["host"] for s in paper_book(n, k)["servers"]]
    traffic = placement.expected_traffic(p.server_bytes(tensors), hosts, hosts[:n])
    ideal = max(h.tx_bytes for h in placement.plan(n, k, sum(nb for _, nb, _ in tensors)).hosts)
    assert max(traffic.values()) / ideal < 1.003, max(traffic.values()) / ideal


def test_small_tensors_go_whole_and_spread_by_weight():
    p = Placement.from_book(paper_book(4, 2), "balanced", 4 << 20)
    counts = [0] * p.num_servers
    for tkey in range(1, 20001):
        (i, off, length, s), = p.partitions(tkey, 1024, 4)
        assert (off, length) == (0, 1024) and p.server(tkey, i) == s
        counts[s] += 1
    for s, c in enumerate(counts):  # 2/20 and 6/20 of the tensors, within sampling noise
        assert abs(c / 20000 - p.shares()[s]) < 0.015


def test_hash_mode_matches_the_weights_on_average():
    p = Placement.from_book(paper_book(4, 2), "hash", 1 << 20)
    load = p.server_bytes([(t, 64 << 20, 4) for t in range(1, 200)])
    total = sum(load)
    for s, b in enumerate(load):
        assert abs(b / total - p.shares()[s]) < 0.02
    # ... but a single tensor's partitions are not balanced: the reason for "balanced"
    one = p.server_bytes([(1, 8 << 20, 4)])
    assert max(abs(b / sum(one) - sh) for b, sh in zip(one, p.shares())) > 0.02


def test_zero_weight_servers_get_nothing():
    p = Placement.from_book(paper_book(3, 5), "balanced", 1 << 20)  # k > n: colocated get 0
    load = p.server_bytes([(1, 10 << 20, 4)])
    assert load[:3] == [0, 0, 0] and all(b > 0 for b in load[3:])


def test_expected_traffic_matches_the_plan():
    n, k, m = 4, 2, 20 << 20  # whole partitions: a short tail would go to one server
    b = paper_book(n, k)
    p = Placement.from_book(b, "balanced", 1 << 20)
    server_hosts = [s["host"] for s in b["servers"]]
    worker_hosts = [w["host"] for w in b["workers"]]
    load = p.server_bytes([(7, m, 4)])
    traffic = placement.expected_traffic(load, server_hosts, worker_hosts)
    for h in traffic.values():
        assert h == pytest.approx(placement.plan(n, k, m).hosts[0].tx_bytes, rel=1e-3)


def test_bpslaunch_plan_prints_the_plan():
    out = subprocess.run([sys.executable, "-m", "byteps.launcher", "--plan", "--worker-machines", "4", "--extra", "2",
                          "--model-bytes", "64MB", "--bandwidth", "100Mbit"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "n=4" in out.stdout and "k=2" in out.stdout and "t_opt" in out.stdout
    assert "0.300000" in out.stdout and "0.100000" in out.stdout  # Eq. 1 and Eq. 2 for n=4, k=2
    bad = subprocess.run([sys.executable, "-m", "byteps.launcher", "--plan", "--worker-machines", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2


# ------------------------------------------------------------- real jobs on several "hosts"
# Loopback has the whole 127.0.0.0/8: workers on 127.0.0.1-3 with a colocated server each and one
# standalone server on 127.0.0.4 form the paper's n = 3, k = 1 layout (weights 2, 2, 2, 4).

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # find scenarios_placement
from conftest import Cluster  # noqa: E402
from scenarios_placement import expected  # noqa: E402

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def run_hosts(tmp_path, scenario, args, env):
    env = dict(env, BYTEPS_LOG_LEVEL="INFO")
    c = Cluster(str(tmp_path), len(HOSTS), len(HOSTS) + 1, env=env).start(servers=False)
    try:
        for i, host in enumerate([*HOSTS, "127.0.0.4"]):
            c.servers.append(c._spawn([sys.executable, "-m", "byteps.server"], "server", {"DMLC_NODE_HOST": host},
                                      log=f"server{i}.log"))
        for wid, host in enumerate(HOSTS):
            c.run_workers(scenario, args, env={"DMLC_NODE_HOST": host}, machines=[wid])
        codes, server_codes, sched = c.wait_all(120)
        assert codes == [0] * len(HOSTS) and server_codes == [0] * (len(HOSTS) + 1) and sched == 0, c.all_logs()
        res = c.results()
        for r in range(len(HOSTS)):
            assert "error" not in res[r], f"rank {r}: {res[r].get('error')}\n{c.all_logs()}"
        return c, res
    finally:
        c.kill_all()


@pytest.mark.parametrize("mode", placement.MODES)
def test_placed_sums_are_exact_on_a_weighted_layout(tmp_path, mode):
    env = {"BYTEPS_PLACEMENT": mode, "BYTEPS_PARTITION_BYTES": "65536"}
    c, res = run_hosts(tmp_path, "placed", {"rounds": 2}, env)
    want = expected(len(HOSTS), range(2), "t")
    for r in range(len(HOSTS)):
        got = res[r]["value"]
        assert got["placement"] == {"weights": [2, 2, 2, 4], "mode": mode,
                                    "roles": ["colocated"] * 3 + ["standalone"]}
        bad = [k for k, v in want.items() if got["sums"][k] != v]
        assert not bad, f"rank {r}: wrong sums for {bad}"
        assert got["sums"]["broadcast"] == res[0]["value"]["sums"]["broadcast"]
    logs = [c.log(f"server{i}") for i in range(4)]
    assert all("is colocated" in log for log in logs[:3]) and "is standalone" in logs[3], logs


def test_balanced_fusion_buffers_are_exact_and_identical(tmp_path):
    env = {"BYTEPS_PLACEMENT": "balanced", "BYTEPS_PARTITION_BYTES": "262144"}
    _, res = run_hosts(tmp_path, "fused", {"steps": 3, "buffer_bytes": 200_000}, env)
    want = expected(len(HOSTS), range(3), "g")
    layouts = set()
    for r in range(len(HOSTS)):
        got = res[r]["value"]["sums"]
        bad = [k for k, v in want.items() if got[k] != v]
        assert not bad, f"rank {r}: wrong sums for {bad}"
        layouts.add(repr((got["buffers"], sorted(got["runs"].items()))))
        assert "'new'" in got["new"] and "fixed after step 1" in got["new"], got["new"]
    assert len(layouts) == 1  # every rank laid the buffers out identically (rank 0's order)
    buffers = res[0]["value"]["sums"]["buffers"]
    assert len(buffers) > 3 and all(n <= 200_000 for _, n in buffers)
