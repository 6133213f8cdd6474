"""What a span is, shared by the recorder, the scheduler's writer and the analysis.

A span is one stage of one partition on one thread: :data:`SPAN_DTYPE`'s fields, times in the
recording process's CLOCK_MONOTONIC nanoseconds. The native threads record exactly this layout
(core/pipeline/bps_trace.h ``BpsSpan``), so a batch travels to the scheduler as one base64 string of the
packed records: no per-span work on the node.
"""
import base64

import numpy as np

from byteps.core.stages import SERVER_STAGES as _SERVER, Stage

#: stage code -> name: the pipeline's one numbering (core/pipeline/bps_stages.h, byteps.core.stages.Stage)
STAGES = {s.value: s.name for s in Stage}
CODES = {name: code for code, name in STAGES.items()}
SERVER_STAGES = tuple(s.name for s in _SERVER)
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
    "COPYD2H": "GPU to page-locked host buffer (a partition's copy: issued -> its event seen by byteps-gpu)",
    "NCCL_REDUCE": "the machine's GPUs reduce a partition onto its root's over NCCL",
    "PCIE_REDUCE": "reserved, not built: the CPU sums PCIe switches' copies",
    "NCCL_BROADCAST": "the result from the root's GPU to every GPU of the machine over NCCL",
    "COPYH2D": "page-locked host buffer to GPU (a partition's result: issued -> its event seen by byteps-gpu)",
}

#: core/pipeline/bps_trace.h BpsSpan, byte for byte
SPAN_DTYPE = np.dtype([("t0", "<u8"), ("t1", "<u8"), ("key", "<u8"), ("round", "<u8"), ("bytes", "<u8"),
                       ("priority", "<i8"), ("server", "<i4"), ("peer", "<i4"), ("tid", "<i4"), ("stage", "<i4")])


def pack(native_raws):
    """One array of the drained native buffers' spans (those begun before tracing started, t0 == 0, left out)."""
    a = np.concatenate([np.empty(0, SPAN_DTYPE)] + [np.frombuffer(r, dtype=SPAN_DTYPE) for r in native_raws])
    return a[a["t0"] > 0]


def encode(a):
    return base64.b64encode(a.tobytes()).decode("ascii")


def decode(text):
    return np.frombuffer(base64.b64decode(text), dtype=SPAN_DTYPE)
