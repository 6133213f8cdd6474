"""What a span is, shared by the recorder, the scheduler's writer and the analysis.

A span is one stage of one partition on one thread: ``(stage, tid, t0, t1, key, round, bytes,
server, priority, peer)`` with times in the recording process's CLOCK_MONOTONIC nanoseconds. The
native threads record the same fields in the same order (core/bps_trace.h ``BpsSpan``), so one
conversion turns a drained native buffer into these rows.
"""
import numpy as np

#: stage code -> name (core/bps_trace.h BpsTraceStage); worker stages first, then server stages
STAGES = {
    1: "QUEUE", 2: "STAGE", 3: "PUSH", 4: "PULL", 5: "COORDINATE", 6: "LOCAL_REDUCE", 7: "LOCAL_BROADCAST",
    8: "RECV", 9: "SUM", 10: "ROUND", 11: "REPLY",
}
CODES = {name: code for code, name in STAGES.items()}
SERVER_STAGES = ("RECV", "SUM", "ROUND", "REPLY")
#: what each stage means, for the docs and the summary's legend
MEANING = {
    "QUEUE": "waiting in the worker's priority queue (and for byte credit)",
    "STAGE": "copy into the shared staging region (colocated server, or a local rank's copy)",
    "PUSH": "handed to the transport until the server's reply arrived: wire both ways plus the server",
    "PULL": "the reply copied into the tensor",
    "COORDINATE": "a non-owner's partition waiting for its machine's result",
    "LOCAL_REDUCE": "sum of the machine's copies by the partition's owner",
    "LOCAL_BROADCAST": "the machine's result copied back into the tensor",
    "RECV": "server: one push taken in (checks; held, or summed inline)",
    "SUM": "server: one summation into the round's store",
    "ROUND": "server: from a round's first push until all pushes are in and summed",
    "REPLY": "server: the round's replies handed to the transport",
}

#: core/bps_trace.h BpsSpan, byte for byte
SPAN_DTYPE = np.dtype([("t0", "<u8"), ("t1", "<u8"), ("key", "<u8"), ("round", "<u8"), ("bytes", "<u8"),
                       ("priority", "<i8"), ("server", "<i4"), ("peer", "<i4"), ("tid", "<i4"), ("stage", "<i4")])
#: field order of a span row
FIELDS = ("stage", "tid", "t0", "t1", "key", "round", "bytes", "server", "priority", "peer")


def rows_from_native(raw):
    """Rows from a drained native buffer's bytes (spans begun before tracing started are dropped)."""
    a = np.frombuffer(raw, dtype=SPAN_DTYPE)
    a = a[a["t0"] > 0]
    cols = [a[f].tolist() for f in FIELDS]
    return [list(r) for r in zip(*cols)]
