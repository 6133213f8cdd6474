"""The server's native data plane (summation/native/bps_server.h, thread byteps-serve): exact sums and the
answers a reference written down here expects.

* exact sums of every dtype (fp16/bf16 and integers included) through real servers, over TCP and
  shared memory, with sums inline and on sum threads, and one pushing machine (its own region back);
* broadcasts of every dtype from every root;
* proof that the native path ran: the server logs how many pushes byteps-serve handled;
* a raw client (an authenticated job member, on its direct link) sends bad rounds, duplicates, length
  and dtype mismatches, a short body, a broadcast from a non-root, good rounds, a push without its body frame,
  and compressed pushes (a round mixing compressed and plain ones, a compressed round answered with
  the re-encoded sum, a malformed blob, a dense size that differs from the header's): the server must
  answer with exactly the messages written down here.
"""
import json
import os
import re
import sys
import time

import numpy as np
import pytest
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from conftest import member_link, server_data_port  # noqa: E402
from test_push_pull import SMALL_SHAPES, check_matrix  # noqa: E402

from byteps import compression as C  # noqa: E402
from byteps.core import shm, wire  # noqa: E402
from byteps.errors import ProtocolError  # noqa: E402
from byteps.core.wire import Cmd  # noqa: E402

NATIVE_LOG = re.compile(r"native data plane: (\d+) pushes handled on byteps-serve, (\d+) rounds completed")


def native_pushes(c, k):
    """Pushes each server's byteps-serve handled (None: it logged none)."""
    out = []
    for i in range(k):
        m = NATIVE_LOG.search(c.log(f"server{i}"))
        out.append(int(m.group(1)) if m else None)
    return out


#: the server says at INFO level which loop served it and what byteps-serve did
INFO = {"BYTEPS_LOG_LEVEL": "INFO"}

POINTS = [(3, 2, True, "0"), (3, 2, False, "0"), (2, 1, True, "2"), (2, 2, False, "3"), (1, 1, True, "0")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,k,ipc,threads", POINTS,
                         ids=[f"{n}w{k}s-{'shm' if i else 'tcp'}-{t}sum" for n, k, i, t in POINTS])
def test_exact_sums_through_the_native_server(cluster, n, k, ipc, threads):
    """Every dtype on small and multi-partition shapes, 3 rounds; (1, 1, shm) is one pushing machine,
    answered with its own shared region."""
    made = []

    def keep(*a, **kw):
        made.append(cluster(*a, **kw))
        return made[-1]
    check_matrix(keep, n, k, SMALL_SHAPES + [(3, 257)], rounds=3, ipc=ipc,
                 extra_env={"BYTEPS_SERVER_ENGINE_THREAD": threads, **INFO})
    pushes = native_pushes(made[0], k)
    assert all(p is not None and p > 0 for p in pushes), (pushes, made[0].all_logs())
    for i in range(k):
        log = made[0].log(f"server{i}")
        assert "on thread byteps-serve" in log, log
        assert "Traceback" not in log, log


@pytest.mark.timeout(150)
def test_broadcasts_through_the_native_server(cluster):
    c = cluster(3, 2, env={"BYTEPS_PARTITION_BYTES": "1000", **INFO})
    c.run_workers("native_broadcasts", {})
    codes, scodes, sched = c.wait_all(120)
    assert codes == [0, 0, 0] and scodes == [0, 0] and sched == 0, c.all_logs()
    for r, res in c.results().items():
        assert "error" not in res, (r, res.get("error"), c.all_logs())
        assert res["value"] and all(res["value"].values()), (r, [k for k, v in res["value"].items() if not v])
    assert all(p and p > 0 for p in native_pushes(c, 2)), c.all_logs()


# ------------------------------------------------------------------------------ the same answers

A, B = 7, 8  # sender node ids the address book does not know: the server names them "node 7", "node 8"
I32 = 4


def K(tensor, part):
    return wire.make_key(tensor, part)


def push(sender, key, rnd, body, dtype=I32, length=None, cmd=Cmd.PUSHPULL, arg=0, flags=0):
    return [wire.pack(cmd, sender=sender, key=key, round=rnd, length=len(body) if length is None else length,
                      dtype=dtype, arg=arg, flags=flags), body]


def ints(*v, dtype=np.int32):
    return np.array(v, dtype=dtype).tobytes()


#: (messages, what each answer is) in order; every answer is (command, key, round, text or body hex)
SCRIPT = [
    push(A, K(1000, 0), 1, ints(1, 2)),                      # wrong round ...
    push(B, K(1000, 0), 0, ints(3, 4)),                      # ... fails the round for both
    push(A, K(1000, 1), 0, ints(1, 2)),                      # the same rank twice
    push(A, K(1000, 1), 0, ints(1, 2)),
    push(A, K(1001, 0), 0, ints(1, 2), dtype=0),             # lengths differ
    push(B, K(1001, 0), 0, ints(1, 2, 3), dtype=0),
    push(A, K(1001, 1), 0, ints(1), length=8),               # the body is shorter than the header says
    push(B, K(1001, 1), 0, ints(1, 2)),
    push(A, K(1002, 0), 0, b"123456", dtype=0),              # not whole elements: answered at once
    push(A, K(1002, 0), 0, b"1234", dtype=200),              # unknown dtype: answered at once
    push(A, K(1002, 1), 0, ints(1, 2)),                      # a good round
    push(B, K(1002, 1), 0, ints(3, 4)),
    push(A, K(1002, 1), 1, ints(1, 2, dtype=np.int64), dtype=5),  # a dtype the last round did not have
    push(B, K(1002, 1), 1, ints(1, 2)),
    push(A, K(1003, 0), 0, ints(1, 2), cmd=Cmd.BROADCAST, arg=0),  # a non-root sends data
    push(B, K(1003, 0), 0, b"", cmd=Cmd.BROADCAST, arg=0),
    push(A, K(1004, 0), 0, ints(5, 6)),                      # two good rounds in a row: exact sums
    push(B, K(1004, 0), 0, ints(1, 1)),
    push(A, K(1004, 0), 1, ints(2, 2)),
    push(B, K(1004, 0), 1, ints(3, 3)),
]
#: compressed pushes (byteps/compression.py), summed by byteps-serve (summation/native/compressed_rounds.h)
F32 = 0
FP16 = C.WireCompressor("fp16", min_bytes=0)


def fp16_blob(*v):
    return FP16.encode(np.array(v, np.float32).view(np.uint8), F32, 0, 0)


SCRIPT += [
    push(A, K(1006, 0), 0, fp16_blob(1, 2), dtype=F32, length=8, flags=wire.FLAG_COMPRESSED),  # compressed and
    push(B, K(1006, 0), 0, ints(3, 4, dtype=np.float32), dtype=F32),                           # plain: differ
    push(A, K(1006, 1), 0, fp16_blob(1, 2), dtype=F32, length=8, flags=wire.FLAG_COMPRESSED),  # a compressed round:
    push(B, K(1006, 1), 0, fp16_blob(3, 4), dtype=F32, length=8, flags=wire.FLAG_COMPRESSED),  # the sum recompressed
    push(A, K(1006, 2), 0, b"XX" + fp16_blob(1, 2)[2:], dtype=F32, length=8, flags=wire.FLAG_COMPRESSED),  # bad
    push(B, K(1006, 2), 0, fp16_blob(3, 4), dtype=F32, length=8, flags=wire.FLAG_COMPRESSED),
    push(A, K(1006, 3), 0, fp16_blob(1, 2), dtype=F32, length=16, flags=wire.FLAG_COMPRESSED),  # length differs
    push(B, K(1006, 3), 0, fp16_blob(3, 4), dtype=F32, length=16, flags=wire.FLAG_COMPRESSED),
    push(A, K(1008, 0), 0, ints(1, 2), cmd=Cmd.ASYNC_PUSHPULL),  # asynchronous, to a synchronous server
    push(A, K(1009, 0), 0, ints(1, 2))[:1],                  # no body frame: refused by Python, with the reason
]
#: shared-memory descriptors a server cannot use: too short, a pid's fd it may not open, a file that is not
#: a byteps arena (this process's stdin); the texts are core/shm.py's, computed here
BAD_DESCRIPTORS = [b"x" * 10, shm.DESCRIPTOR.pack(1, 99, 0, 0, 8), shm.DESCRIPTOR.pack(os.getpid(), 0, 0, 0, 8)]
for i, desc in enumerate(BAD_DESCRIPTORS):
    SCRIPT += [push(A, K(1005, i), 0, desc, length=8, flags=wire.FLAG_SHM), push(B, K(1005, i), 0, ints(1, 2))]


def _answer(frames):
    h = wire.unpack(frames[0])
    body = frames[1] if len(frames) > 1 else b""
    if h.cmd == Cmd.ERROR:
        return [Cmd(h.cmd).name, list(wire.split_key(h.key)), h.round, json.loads(body)["error"]]
    return [Cmd(h.cmd).name, list(wire.split_key(h.key)), h.round, h.dtype, h.flags, bytes(body).hex()]


def _k(t, p):
    return f"key ({t}, {p})"


def _err(t, p, rnd, text):
    return ["ERROR", [t, p], rnd, f"{_k(t, p)}: {text}"]


def _reply(t, p, rnd, values, dtype=I32):
    return ["REPLY", [t, p], rnd, dtype, 0, ints(*values).hex()]


EXPECTED = [
    *[_err(1000, 0, 0, "rank node 7 sent round 1 while the server is at round 0")] * 2,
    *[_err(1000, 1, 0, "rank node 7 sent round 0 twice")] * 2,
    *[_err(1001, 0, 0, "rank node 8 pushed 12 bytes of float32 but rank node 7 pushed 8 bytes of float32")] * 2,
    *[_err(1001, 1, 0, "rank node 7's header says 8 bytes but 4 arrived")] * 2,
    _err(1002, 0, 0, "rank node 7 sent 6 bytes of dtype code 0: not whole elements of a known dtype"),
    _err(1002, 0, 0, "rank node 7 sent 4 bytes of dtype code 200: not whole elements of a known dtype"),
    *[_reply(1002, 1, 0, (4, 6))] * 2,
    *[_err(1002, 1, 1, "rank node 7 pushed 16 bytes of int64 but rank in round 0, every rank pushed 8 bytes "
                       "of int32")] * 2,
    *[_err(1003, 0, 0, "non-root rank node 7 sent 8 bytes with a broadcast")] * 2,
    *[_reply(1004, 0, 0, (6, 7))] * 2,
    *[_reply(1004, 0, 1, (5, 5))] * 2,
    *[_err(1006, 0, 0, "compression differs across workers: rank node 7 pushed fp16(), rank node 8 pushed no "
                       "compression; every worker must compress this tensor alike (same method, options, seed and "
                       "BYTEPS_MIN_COMPRESS_BYTES)")] * 2,
    *[["REPLY", [1006, 1], 0, F32, wire.FLAG_COMPRESSED, fp16_blob(4, 6).hex()]] * 2,
    *[_err(1006, 2, 0, "rank node 7's compressed push: bad compression magic b'XX'")] * 2,
    *[_err(1006, 3, 0, "rank node 7's compressed push decodes to 8 bytes of dtype code 0 but its header says 16 "
                       "bytes of float32")] * 2,
    ["ERROR", [1008, 0], 0, "asynchronous push_pull sent to a synchronous server (BYTEPS_ENABLE_ASYNC differs)"],
    _err(1009, 0, 0, "rank node 7 sent a PUSHPULL without its body frame"),
]


def _shm_error(desc):
    try:
        shm.PeerMaps().view(desc)
    except ProtocolError as e:
        return str(e)
    raise AssertionError("a bad descriptor was accepted")


for i, desc in enumerate(BAD_DESCRIPTORS):
    EXPECTED += [_err(1005, i, 0, f"rank node 7's shared memory: {_shm_error(desc)}")] * 2


def _by_key(answers):
    out = {}
    for a in answers:
        out.setdefault(tuple(a[1]), []).append(a)
    return out


def _answers(port):
    ctx = zmq.Context()
    try:
        link = member_link(ctx, port)  # partitions travel over direct links only, as a worker's do
        try:
            for frames in SCRIPT:
                link.send_multipart(frames)
            out = []
            deadline = time.monotonic() + 30
            while len(out) < len(EXPECTED) and time.monotonic() < deadline:
                if link.poll(100):
                    out.append(_answer(link.recv_multipart()))
            time.sleep(0.3)  # nothing more may come
            while link.poll(0):
                out.append(_answer(link.recv_multipart()))
            assert not link.dealer.poll(0), "every answer must come on the link, not on ZeroMQ"
            return out
        finally:
            link.close()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(150)
def test_answers_to_bad_and_mixed_rounds(cluster):
    c = cluster(2, 1, env=INFO)
    c.run_workers("wait_then_sum", {"wait": 120})
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(c.tmp, f"progress.{r}")) for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in c.workers), c.all_logs()
        time.sleep(0.05)
    got = _answers(server_data_port(c.servers[0].pid))
    open(os.path.join(c.tmp, "go"), "w").close()
    codes, scodes, sched = c.wait_all(120)
    # per key in order (answers of different keys may interleave: Python answers what it refuses on its own thread)
    assert _by_key(got) == _by_key(EXPECTED), "\n".join(map(str, got))
    assert codes == [0, 0] and scodes == [0] and sched == 0, c.all_logs()
    for r, res in c.results().items():  # the job still sums exactly
        assert res.get("value") == {"before": True, "after": True, "after_i": True}, (r, res, c.all_logs())
    pushes = native_pushes(c, 1)[0]
    # every push of SCRIPT but the one without a body (Python's) and the two answered before any state
    assert pushes is not None and pushes >= len(SCRIPT) - 3, c.log("server0")
    assert "rank node 7 sent round 0 twice" in c.log("server0")  # failed rounds are logged, as before
