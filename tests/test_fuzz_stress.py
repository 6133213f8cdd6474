"""Fuzzing at scale: the frame parser offline, and live servers, workers and the scheduler.

* Parser (``core/wire.py``): at least 100,000 hypothesis inputs (``-m slow``): random bytes and
  valid headers with random fields and byte-level mutations. Every input either raises
  ``ProtocolError`` or parses into a header that packs back to the same bytes and whose length is
  within the command's bound. Control bodies (``decode``) and shared-memory descriptors
  (``PeerMaps.view``) get the same treatment. With atheris installed, a coverage-guided run of
  100,000 inputs over the same targets runs too (skipped otherwise).
* Live: a running job (2 workers, 2 servers) gets mutated frames on every socket a stranger can
  reach: the servers' data sockets, the workers' local-reduce sockets and the scheduler, from an
  unauthenticated peer and from an authenticated one (it knows the job's secret, so it is a
  buggy job member, not a stranger). Frames have random commands, dtypes, flags, senders, keys,
  rounds, frame counts, bodies, and length fields up to 2^64-1 with tiny bodies; the member also
  sends well-formed pairs of pushes that complete rounds. A server's member sends half its frames,
  and every well-formed round, on a direct link (where partitions travel; ZeroMQ is the control
  plane, and a server refuses data there), the rest on its DEALER. Afterwards every process must still run,
  its memory (RSS, and address space: a length field never allocates) must not have grown, the
  stranger must have had nothing but handshake answers (a CHALLENGE; the scheduler's refusal),
  and real push_pulls must still give the exact sums. ``-m slow`` sends 20,000 messages per peer.
  The authenticated fuzzer uses tensor keys the job does not use (a job member can break its own
  job's rounds; that is not a parser property).
"""
import json
import os
import random
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from collections import Counter

import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # --import-mode=importlib: find conftest
from conftest import FAST_ENV, member_link, server_data_port  # noqa: E402

from byteps.core import auth, shm, wire  # noqa: E402
from byteps.errors import ProtocolError  # noqa: E402

Cmd = wire.Cmd
PARSER_EXAMPLES = 100_000

# ------------------------------------------------------------------------------ offline parser fuzzing

u8, u16, u32, u64 = (st.integers(0, (1 << b) - 1) for b in (8, 16, 32, 64))
lengths = st.one_of(u64, st.sampled_from([0, 1, 40, wire.MAX_CONTROL_BODY, wire.MAX_CONTROL_BODY + 1, (1 << 31) - 1,
                                          1 << 31, 1 << 32, wire.MAX_BODY, wire.MAX_BODY + 1, (1 << 64) - 1]))
commands = st.one_of(st.sampled_from([int(c) for c in Cmd]), u8)


@st.composite
def headers(draw):
    """A header with random fields (mostly known commands), then random byte edits."""
    raw = bytearray(wire.HEADER.pack(wire.MAGIC, draw(st.sampled_from([wire.VERSION, wire.VERSION, 0, 2, 255])),
                                     draw(commands), draw(u8), draw(u8), draw(st.sampled_from([0, 0, 0, 1, 65535])),
                                     draw(u32), draw(u32), draw(u64), draw(u64), draw(lengths)))
    for _ in range(draw(st.integers(0, 3))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(u8)
    cut = draw(st.sampled_from([None, None, None, 0, 1, 39, 41]))
    if cut is not None:
        raw = raw[:cut] if cut <= len(raw) else raw + bytes(cut - len(raw))
    return bytes(raw)


def check_header(data):
    """The parser's contract for one input."""
    try:
        h = wire.unpack(data)
    except ProtocolError:
        return False
    assert len(data) == wire.HEADER_SIZE and data[:2] == wire.MAGIC and data[2] == wire.VERSION
    assert h.cmd in set(int(c) for c in Cmd)
    limit = wire.MAX_BODY if h.cmd in wire._DATA_CMDS else wire.MAX_CONTROL_BODY
    assert 0 <= h.length <= limit
    reserved = struct.unpack_from("<H", data, 6)[0]
    again = wire.pack(h.cmd, sender=h.sender, key=h.key, round=h.round, length=h.length, dtype=h.dtype, arg=h.arg,
                      flags=h.flags)
    assert again == data[:6] + b"\0\0" + data[8:] and (reserved == 0) == (again == data)
    return True


def check_body(data):
    try:
        assert isinstance(wire.decode(data), dict)
    except ProtocolError:
        pass


def check_descriptor(maps, data):
    """Descriptors naming our own fds with random offsets/inodes: always ProtocolError, never a mapping."""
    try:
        maps.view(data)
    except ProtocolError:
        return
    raise AssertionError(f"a random descriptor {data.hex()} opened shared memory")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_parser_100k_inputs():
    seen = {"inputs": 0, "parsed": 0}

    @settings(max_examples=PARSER_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(headers(), st.binary(max_size=64)))
    def run(data):
        seen["inputs"] += 1
        seen["parsed"] += check_header(data)

    start = time.monotonic()
    run()
    print(f"wire.unpack: {seen['inputs']} inputs ({seen['parsed']} valid headers) in "
          f"{time.monotonic() - start:.1f} s", flush=True)
    assert seen["inputs"] >= PARSER_EXAMPLES and seen["parsed"] > 1000, seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_control_bodies_and_descriptors_20k_inputs():
    maps = shm.PeerMaps()
    json_bodies = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                               lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                               max_leaves=10).map(lambda o: json.dumps(o).encode())
    descriptors = st.builds(lambda fd, inode, off, n: shm.DESCRIPTOR.pack(os.getpid(), fd, inode, off, n),
                            st.integers(-2, 64), u64, u64, u64)

    @settings(max_examples=20_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(json_bodies, st.binary(max_size=300)), st.one_of(descriptors, st.binary(max_size=40)))
    def run(body, desc):
        check_body(body)
        check_descriptor(maps, desc)

    run()
    assert not maps.maps  # nothing was mapped


ATHERIS_TARGET = textwrap.dedent("""
    import os, sys
    import atheris
    with atheris.instrument_imports():
        from byteps.core import shm, wire
        from byteps.errors import ProtocolError
    maps = shm.PeerMaps()
    def one(data):
        fdp = atheris.FuzzedDataProvider(data)
        which = fdp.ConsumeIntInRange(0, 2)
        rest = fdp.ConsumeBytes(fdp.remaining_bytes())
        try:
            if which == 0:
                h = wire.unpack(rest)
                assert len(rest) == wire.HEADER_SIZE and h.length <= wire.MAX_BODY
            elif which == 1:
                assert isinstance(wire.decode(rest), dict)
            else:  # a descriptor naming one of our own fds, with fuzzed fd, inode, offset and length
                maps.view(os.getpid().to_bytes(4, "little") + rest[:28].ljust(28, b"\\0"))
                raise AssertionError("a fuzzed descriptor opened shared memory")
        except ProtocolError:
            pass
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
""")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_parser_atheris_100k_runs(tmp_path):
    pytest.importorskip("atheris")
    target = tmp_path / "fuzz_wire.py"
    target.write_text(ATHERIS_TARGET)
    start = time.monotonic()
    p = subprocess.run([sys.executable, str(target), f"-runs={PARSER_EXAMPLES}", "-max_len=128", "-seed=7",
                        f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True, timeout=1100)
    print(f"atheris: {PARSER_EXAMPLES} runs in {time.monotonic() - start:.1f} s; {p.stderr.strip().splitlines()[-1]}",
          flush=True)
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"Done {PARSER_EXAMPLES} runs" in p.stderr, p.stderr[-2000:]


# ------------------------------------------------------------------------------ live fuzzing


def _ports(pid):
    return sorted(c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
                  if c.status == psutil.CONN_LISTEN)


SPECIAL_LENGTHS = [0, 1, 3, 7, 40, 4096, (1 << 31) - 1, 1 << 31, (1 << 32) + 8, wire.MAX_BODY, wire.MAX_BODY + 1,
                   (1 << 64) - 1]


def mutated_frames(rng, keys, senders):
    """One random message (a list of frames) for a ROUTER: headers with random fields, bodies that
    agree or disagree with the length field, extra or missing frames, byte edits."""
    cmd = rng.choice([*[int(c) for c in Cmd], *[Cmd.PUSHPULL] * 6, *[Cmd.BROADCAST] * 2, rng.randrange(256)])
    dtype = rng.choice([0, 0, 1, 4, 5, 6, 2, 3, 7, 8, 200, 255])
    flags = rng.choice([0, 0, 0, wire.FLAG_SHM, rng.randrange(256)])
    kind = rng.random()
    if kind < 0.35:       # a body that matches the length (a plausible partition)
        body = rng.randbytes(rng.choice([0, 4, 8, 12, 64, 1000, 4096, 65536]))
        length = len(body)
    elif kind < 0.6:      # a length field far larger than the body: must never allocate it
        body = rng.randbytes(rng.randrange(0, 64))
        length = rng.choice(SPECIAL_LENGTHS)
    elif kind < 0.75:     # a shared-memory descriptor naming random or real pids/fds
        body = shm.DESCRIPTOR.pack(rng.choice([os.getpid(), 1, rng.randrange(1 << 31)]), rng.randrange(-2, 64),
                                   rng.randrange(1 << 64), rng.choice([0, rng.randrange(1 << 64)]),
                                   rng.choice([0, 4, 4096, rng.randrange(1 << 64)]))
        length = rng.choice([len(body), 4096, rng.randrange(1 << 33)])
    elif kind < 0.85:     # JSON
        body = json.dumps(rng.choice([{}, {"error": "x"}, {"nonce": "00"}, {"mac": "ab"}, [1, 2], "s",
                                      {"epoch": 0, "done": True}])).encode()
        length = len(body)
    else:
        body = rng.randbytes(rng.randrange(0, 200))
        length = rng.randrange(1 << 64)
    header = bytearray(wire.HEADER.pack(wire.MAGIC, wire.VERSION, cmd & 0xFF, dtype, flags, 0, rng.choice(senders),
                                        rng.randrange(1 << 32), rng.choice(keys), rng.choice([0, 0, 1, 2,
                                                                                              rng.randrange(1 << 64)]),
                                        min(length, (1 << 64) - 1)))
    if rng.random() < 0.15:
        for _ in range(rng.randint(1, 4)):
            header[rng.randrange(len(header))] = rng.randrange(256)
    frames = [bytes(header), body]
    shape = rng.random()
    if shape < 0.08:
        frames = [bytes(header)]
    elif shape < 0.14:
        frames = frames + [rng.randbytes(rng.randrange(0, 50)) for _ in range(rng.randint(1, 3))]
    elif shape < 0.18:
        frames = [bytes(header)[:rng.randrange(40)], body]
    elif shape < 0.2:
        frames = [rng.randbytes(rng.randrange(0, 100))]
    return frames


def coherent_round(rng, keys):
    """Two pushes that agree (rank 0 and rank 1, one key, round, dtype and length): they complete a
    round when the key's state allows it, reaching the sum kernels and the replies."""
    dtype = rng.choice([0, 1, 4, 5, 6, 7])
    length = rng.choice([0, 8, 64, 4096, 65536])
    key, rnd = rng.choice(keys), rng.choice([0, 0, 1, 2])
    cmd = rng.choice([Cmd.PUSHPULL, Cmd.PUSHPULL, Cmd.BROADCAST])
    return [[wire.pack(cmd, sender=r, key=key, round=rnd, length=length if cmd == Cmd.PUSHPULL or r == 0 else 0,
                       dtype=dtype, arg=0), rng.randbytes(length if cmd == Cmd.PUSHPULL or r == 0 else 0)]
            for r in (0, 1)]


class Fuzzer:
    """A DEALER connected to one ROUTER; optionally authenticated with the job's secret. With ``link``
    (a server's data port), a job member's direct link instead (conftest.member_link): where partitions
    travel, so what it sends reaches the server's rounds; on its DEALER a server refuses data."""

    def __init__(self, ctx, port, secret=None, link=False):
        self.answers = Counter()  # command name -> count of messages the peer sent us
        if link:
            self.sock = member_link(ctx, port)
            self.identity = self.sock.identity
            return
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.identity = auth.new_identity()
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        if secret is not None:
            knock = auth.Knock(secret, self.identity)
            self.sock.send_multipart(wire.control(Cmd.HELLO, body=knock.hello()))
            assert self.sock.poll(20000), "no CHALLENGE from the peer"
            header, body = self.sock.recv_multipart()
            assert wire.unpack(header).cmd == Cmd.CHALLENGE
            self.sock.send_multipart(wire.control(Cmd.AUTH, body={"mac": knock.answer(wire.decode(body), "peer")}))

    def send(self, frames):
        self.sock.send_multipart(frames)
        self.drain()

    def sync(self, timeout=60):
        """Send a HELLO and wait for its CHALLENGE: the peer has then handled every earlier frame of ours."""
        before = self.answers["CHALLENGE"]
        self.sock.send_multipart(wire.control(Cmd.HELLO, body={"nonce": "00"}))
        deadline = time.monotonic() + timeout
        while self.answers["CHALLENGE"] == before:
            assert time.monotonic() < deadline, "the peer did not answer a HELLO after the fuzzing"
            self.sock.poll(100)
            self.drain()

    def drain(self):
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            try:
                self.answers[Cmd(wire.unpack(frames[0]).cmd).name] += 1
            except (ProtocolError, ValueError):
                self.answers["malformed"] += 1


def _memory(pid):
    """(RSS, VMS) in bytes."""
    m = psutil.Process(pid).memory_info()
    return m.rss, m.vms


def live_fuzz(cluster, frames_per_peer, seed, layout="2x1", ipc="1"):
    """Fuzz a running job (see the module docstring); returns a summary for the test to print."""
    rng = random.Random(seed)
    machines, local = (2, 1) if layout == "2x1" else (1, 2)
    c = cluster(machines, 2, local_size=local, env={"BYTEPS_ENABLE_IPC": ipc})
    c.run_workers("wait_then_sum", {"wait": 600})
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(c.tmp, f"progress.{r}")) for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in c.workers), c.all_logs()
        time.sleep(0.05)
    secret = FAST_ENV["BYTEPS_JOB_SECRET"].encode()
    targets = [(f"server{i}", p.pid, server_data_port(p.pid)) for i, p in enumerate(c.servers)]
    if local > 1:  # each worker's local-reduce ROUTER
        targets += [(f"worker0.{lr}", p.pid, _ports(p.pid)[0]) for lr, p in enumerate(c.workers)]
    before = {name: _memory(pid) for name, pid, _ in targets}
    ctx = zmq.Context()
    summary = {"frames": 0}
    start = time.monotonic()
    try:
        strangers = [Fuzzer(ctx, port) for _, _, port in targets]
        sched_stranger = Fuzzer(ctx, c.port)  # the scheduler's control socket
        members = [Fuzzer(ctx, port, secret) for _, _, port in targets]
        # each server's member also has a direct link, where partitions travel: what it sends there
        # reaches the rounds and sum kernels (its DEALER gets the control plane, and data it refuses)
        links = {i: Fuzzer(ctx, port, link=True) for i, (name, _, port) in enumerate(targets)
                 if name.startswith("server")}
        # keys the job uses (tensor keys 1..3, partitions 0..1) for strangers; others for members
        job_keys = [wire.make_key(t, p) for t in (1, 2, 3) for p in (0, 1)] + [0]
        spare_keys = [wire.make_key(t, p) for t in (1000, 1001, 77777, 0xFFFFFFFF) for p in (0, 1, 5)]
        for i in range(frames_per_peer):
            for f in [*strangers, sched_stranger]:
                f.send(mutated_frames(rng, job_keys + spare_keys, [0, 1, 2, wire.NO_SENDER, 1 << 20]))
            for t, f in enumerate(members):
                data = links.get(t, f)  # a server's member: half its mutated frames on the link
                (data if rng.random() < 0.5 else f).send(mutated_frames(rng, spare_keys, [0, 1, 2, wire.NO_SENDER]))
                if rng.random() < 0.1:  # a well-formed round from two "ranks": the sum and reply paths
                    for frames in coherent_round(rng, spare_keys):
                        data.send(frames)
            summary["frames"] += len(strangers) + 1 + len(members)
            if i % 2000 == 0:  # everyone must keep up (and keep heartbeating) meanwhile
                assert all(p.poll() is None for p in [c.scheduler, *c.servers, *c.workers]), c.all_logs()
        for f in [*strangers, sched_stranger, *members, *links.values()]:
            f.sync()
        summary["stranger_answers"] = dict(sum((f.answers for f in strangers), Counter()))
        summary["scheduler_answers"] = dict(sched_stranger.answers)
        summary["member_answers"] = dict(sum((f.answers for f in members), Counter()))
        on_router = sum((members[t].answers for t in links), Counter())  # servers' DEALER members
        summary["link_answers"] = dict(sum((f.answers for f in links.values()), Counter()))
    finally:
        for f in links.values():
            f.sock.close()
        ctx.destroy(linger=0)
    summary["seconds"] = round(time.monotonic() - start, 1)
    alive = {name: psutil.Process(pid).is_running() for name, pid, _ in targets}
    assert all(alive.values()) and c.scheduler.poll() is None, f"{alive}\n{c.all_logs()}"
    after = {name: _memory(pid) for name, pid, _ in targets}
    summary["memory_mb"] = {name: [round(before[name][0] / 2 ** 20), round(after[name][0] / 2 ** 20),
                                   round(after[name][1] / 2 ** 20)] for name in before}
    for name in before:
        rss0, vms0 = before[name]
        rss1, vms1 = after[name]
        # a length field of up to 2^64-1 bytes must not be allocated, resident or not
        assert rss1 - rss0 < 256 << 20, f"{name}: RSS grew from {rss0 >> 20} to {rss1 >> 20} MiB"
        assert vms1 - vms0 < 1 << 30, f"{name}: address space grew from {vms0 >> 20} to {vms1 >> 20} MiB"
    # a stranger gets handshake answers (a CHALLENGE; the scheduler's refusal), never data or job state
    assert set(summary["stranger_answers"]) <= {"CHALLENGE"}, summary
    assert set(summary["scheduler_answers"]) <= {"CHALLENGE", "ERROR"}, summary
    assert set(summary["member_answers"]) <= {"CHALLENGE", "REPLY", "ERROR", "PROBE", "LINK"}, summary  # PROBE: echoed; LINK: a token
    assert set(summary["link_answers"]) <= {"CHALLENGE", "REPLY", "ERROR", "PROBE", "LINK"}, summary
    assert summary["link_answers"].get("REPLY", 0) > 0, summary  # well-formed rounds on the links were summed
    assert "REPLY" not in on_router, (on_router, summary)  # data on a server's ROUTER is refused, never summed
    # the job still sums exactly
    open(os.path.join(c.tmp, "go"), "w").close()
    codes, scodes, sched = c.wait_all(120)
    assert codes == [0, 0] and scodes == [0, 0] and sched == 0, c.all_logs()
    for r, res in c.results().items():
        assert res.get("value") == {"before": True, "after": True, "after_i": True}, (r, res, c.all_logs())
    for i in range(2):
        log = c.log(f"server{i}")
        assert "ignored data from an unauthenticated peer" in log and "rejected a malformed data message" in log, log
    return summary


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["2x1", "1x2"])
def test_live_fuzz_quick(cluster, layout):
    print(live_fuzz(cluster, 300, seed=1, layout=layout), flush=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout,ipc", [("2x1", "1"), ("2x1", "0"), ("1x2", "1")])
def test_live_fuzz_stress(cluster, layout, ipc):
    print(live_fuzz(cluster, 20000, seed=zlib.crc32(f"{layout}-{ipc}".encode()), layout=layout, ipc=ipc), flush=True)
