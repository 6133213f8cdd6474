"""Horovod's process sets on real 4-rank jobs (tests/scenarios_psets.py): a set's tensors are summed
by the servers for its members only, with keys of their own; static and dynamic sets; 4 machines
of one process, and 2 machines of two (a set's members push themselves, past the local reduce)."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_psets
from conftest import Cluster  # noqa: E402
from scenarios_psets import A, B, DYN, gather_rows, pset_input  # noqa: E402

N = 4


def run(tmp_path, machines, local_size, servers=2):
    c = Cluster(str(tmp_path), machines, servers, local_size).start()
    try:
        c.run_workers("hvd_process_sets", {"no_init": True})
        codes = c.wait_workers(180)
        assert codes == [0] * N, f"worker exit codes {codes}\n{c.all_logs()}"
        res = c.results()
        assert sorted(res) == list(range(N)), c.all_logs()
        return [res[r]["value"] for r in range(N)]
    finally:
        c.kill_all()


@pytest.fixture(scope="module", params=[(4, 1), (2, 2)], ids=["4x1", "2x2"])
def vals(request, tmp_path_factory):
    machines, local = request.param
    return run(tmp_path_factory.mktemp(f"psets{machines}x{local}"), machines, local)


def total(ranks, scale=1):
    return sum(pset_input(r) * scale for r in ranks)


@pytest.mark.timeout(240)
def test_static_sets_sum_their_members_only(vals):
    for r, v in enumerate(vals):
        assert v["ids"] == [1, 2]
        assert v["global_sum"] == total(range(N)).tolist()
        assert v["global_after"] == total(range(N)).tolist()
        assert "not a registered process set" in v["unregistered"]
        for label, ranks in (("A", A), ("B", B)):
            if r not in ranks:
                assert "not a member" in v[f"{label}.non_member"], v[f"{label}.non_member"]
                continue
            s = total(ranks)
            assert v[f"{label}.sum"] == s.tolist() and v[f"{label}.inplace"] == s.tolist(), (r, label)
            assert v[f"{label}.avg"] == (s / len(ranks)).tolist()
            assert v[f"{label}.max"] == torch.stack([pset_input(q) for q in ranks]).amax(0).tolist()
            assert v[f"{label}.grouped"] == [s.tolist(), (2 * s).tolist()]
            assert v[f"{label}.grad"] == [[float(len(ranks))] * 3] * 4  # d(sum)/dx, allreduced in the set
            me, n = ranks.index(r), len(ranks)
            counts = [4 // n + (q < 4 % n) for q in range(n)]  # 4 rows: Horovod's blocks, extra rows first
            assert v[f"{label}.rs"] == s[sum(counts[:me]):sum(counts[:me + 1])].tolist()


@pytest.mark.timeout(240)
def test_set_ops_run_on_the_native_core(vals):
    """A set's ops run on the native core's stages (byteps.metrics()), on 4x1 and on 2x2 machines, where
    a set's members push past the machine's local reduce: every push answered."""
    for r, v in enumerate(vals):
        assert v["native_ops"] > 20, (r, v["native_ops"])
        assert v["stages"].get("push", 0) == v["stages"].get("pull", 0) > 20, (r, v["stages"])


@pytest.mark.timeout(240)
def test_distributed_optimizer_in_a_set(vals):
    want = (1 - total(B) / len(B)).tolist()  # SGD(lr=1) from ones with the members' averaged gradient
    for r, v in enumerate(vals):
        assert v.get("B.optimizer") == (want if r in B else None), r


@pytest.mark.timeout(240)
def test_set_rank_allgather_broadcast_alltoall(vals):
    for r, v in enumerate(vals):
        a_in, b_in = r in A, r in B
        assert v["set_rank"] == [A.index(r) if a_in else None, B.index(r) if b_in else None, 2, 3, a_in, b_in]
        for label, ranks in (("A", A), ("B", B)):
            if r not in ranks:
                continue
            assert v[f"{label}.gather"] == [[float(q)] * 2 for q in ranks for _ in range(gather_rows(q))]
            assert v[f"{label}.bcast"] == pset_input(ranks[-1]).tolist()
            assert "not a member" in v[f"{label}.bad_root"]
            me = ranks.index(r)
            assert v[f"{label}.a2a"] == [(pset_input(q)[me] + 1000 * q).tolist() for q in ranks]
            assert v[f"{label}.obj"] == [{"r": q} for q in ranks]


@pytest.mark.timeout(240)
def test_dynamic_sets(vals):
    for r, v in enumerate(vals):
        assert v["dyn_id"] == 3
        assert "exists already" in v["dyn_dup"]
        if r in DYN:
            assert v["dyn_sum"] == total(DYN).tolist()
        assert v["dyn_removed"] is True and v["global_removed"] is False
        assert "not a registered process set" in v["dyn_after_remove"]
        assert "same process set" in v["mismatch"] and "rank 0: [0, 1]" in v["mismatch"]
        assert v["again"] == 3  # the mismatched add registered nothing; removed ids are reused
        assert v["end"] == [4.0, 4.0]
