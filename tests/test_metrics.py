"""byteps.metrics(): the public introspection API, read by a real job's workers."""
import pytest


def test_metrics_report_the_data_plane(cluster):
    """Two single-process machines, two servers: each server's bytes, the agreed partition size, the
    declared tensors and the ops the native pipeline ran whole, as plain data."""
    c = cluster(2, 2)
    c.run_workers("metrics_snapshot", {"numel": 1 << 20})
    codes, _, _ = c.wait_all(120)
    assert codes == [0, 0], c.all_logs()
    res = c.results()
    for r in (0, 1):
        m = res[r]["value"]
        assert m["exact"], m
        assert (m["rank"], m["size"], m["local_size"]) == (r, 2, 1)
        assert [s["index"] for s in m["servers"]] == [0, 1]
        # the test's machines share one host: both servers are colocated, so what crosses the sockets
        # is headers and shared-memory descriptors, never the 3 x 4 MiB of data
        assert all(s["colocated"] and 0 < s["bytes_sent"] < 1 << 20 and s["bytes_received"] > 0
                   for s in m["servers"]), m
        assert m["partition_bytes"] > 0 and m["credit_bytes"] >= m["partition_bytes"]
        assert set(m["tensors"]) == {"metrics.t"}
        assert m["native"]["ops"] == 3 and m["native"]["stages"].get("push", 0) > 0, m
        assert all(s["transport"] == "tcp" or s["transport"].startswith("ucx") for s in m["servers"]), m["servers"]


def test_metrics_need_init():
    import byteps
    from byteps.errors import NotInitializedError

    if byteps.is_initialized():
        pytest.skip("a job is running in this process")
    with pytest.raises(NotInitializedError):
        byteps.metrics()
