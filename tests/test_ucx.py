"""The UCX transport (core/bps_ucx.h, BYTEPS_TRANSPORT=ucx) over UCX's tcp and shared-memory transports.

These machines have no RDMA NIC, so UCX runs its tcp and sm (posix) transports here; the code path is
the one a verbs host runs (docs/ucx.md). Skipped, with the reason, where byteps was built without UCX
headers or no libucp loads.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from test_push_pull import SMALL_SHAPES, check_matrix  # noqa: E402

from byteps.core import _worker_core, ucx  # noqa: E402

_OK, _WHY = ucx.load(_worker_core)
pytestmark = pytest.mark.skipif(not _OK, reason=f"UCX unavailable: {_WHY}")

UCX_ENV = {"BYTEPS_TRANSPORT": "ucx"}


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
    assert all(used in t for r in range(n) for t in res[r]["link_transports"]), res[0]["link_transports"]
