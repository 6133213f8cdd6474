"""Unit tier: the wire header and the environment parser (no processes)."""
import pytest
from hypothesis import given, settings, strategies as st

from byteps import config
from byteps.core import wire
from byteps.errors import ConfigError, ProtocolError


def test_header_round_trip():
    raw = wire.pack(wire.Cmd.PUSHPULL, sender=3, key=wire.make_key(7, 2), round=9, length=4096, dtype=2, arg=1)
    assert len(raw) == wire.HEADER_SIZE == 40
    h = wire.unpack(raw)
    assert (h.cmd, h.sender, h.key, h.round, h.length, h.dtype, h.arg) == (wire.Cmd.PUSHPULL, 3, (7 << 32) | 2, 9,
                                                                          4096, 2, 1)
    assert wire.split_key(h.key) == (7, 2)



def test_the_native_wire_constants_equal_wire_py():
    """core/transport/bps_wire.h restates core/wire.py's commands and flags for the native threads."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "core/transport/bps_wire.h").read_text()
    native = {m[0]: int(m[1]) for m in re.findall(r"BPS_((?:CMD|FLAG)_\w+) = (\d+)", text)}
    assert len(native) > 10, native
    for name, value in native.items():
        kind, _, rest = name.partition("_")
        want = int(wire.Cmd[rest]) if kind == "CMD" else getattr(wire, name)
        assert value == want, (name, value, want)
    assert wire.FLAG_ABANDON not in (wire.FLAG_SHM, wire.FLAG_COMPRESSED, wire.FLAG_JOIN_EPOCH)


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b[:-1], "expected 40"),
    (lambda b: b"XX" + b[2:], "bad magic"),
    (lambda b: b[:2] + bytes([99]) + b[3:], "wire version 99"),
    (lambda b: b[:3] + bytes([200]) + b[4:], "unknown command"),
])
def test_malformed_headers_are_rejected(mutate, msg):
    raw = wire.pack(wire.Cmd.PUSHPULL, length=8)
    with pytest.raises(ProtocolError, match=msg):
        wire.unpack(mutate(raw))


def test_body_lengths_are_bounded():
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.unpack(wire.pack(wire.Cmd.DECLARE, length=wire.MAX_CONTROL_BODY + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.unpack(wire.pack(wire.Cmd.PUSHPULL, length=wire.MAX_BODY + 1))


@settings(max_examples=3000, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_random_bytes_never_crash_the_parser(data):
    try:
        h = wire.unpack(data)
    except ProtocolError:
        return
    assert h.length <= wire.MAX_BODY


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_control_bodies(data):
    try:
        assert isinstance(wire.decode(data), dict)
    except ProtocolError:
        pass


BASE = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_WORKER_ID": "1",
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}


def test_valid_worker_config():
    cfg = config.load(dict(BASE, BYTEPS_LOCAL_SIZE="2", BYTEPS_LOCAL_RANK="1"))
    assert (cfg.worker_id, cfg.local_rank, cfg.local_size, cfg.partition_bytes) == (1, 1, 2, 4096000)
    assert cfg.distributed and cfg.node_host == "127.0.0.1"
    assert cfg.scheduler_endpoint == "tcp://127.0.0.1:9000"


def test_standalone_worker_needs_no_variables():
    cfg = config.load({})
    assert (cfg.num_worker, cfg.local_size, cfg.distributed) == (1, 1, False)


@pytest.mark.parametrize("name,value,needle", [
    ("DMLC_NUM_WORKER", "abc", "DMLC_NUM_WORKER='abc' is not an integer"),
    ("DMLC_NUM_WORKER", "-1", "DMLC_NUM_WORKER=-1 must be >= 1"),
    ("DMLC_WORKER_ID", "2", "DMLC_WORKER_ID=2 must be < DMLC_NUM_WORKER=2"),
    ("DMLC_PS_ROOT_PORT", "70000", "DMLC_PS_ROOT_PORT=70000 must be <= 65535"),
    ("DMLC_PS_ROOT_PORT", "0", "DMLC_PS_ROOT_PORT=0 must be >= 1"),
    ("DMLC_ROLE", "boss", "DMLC_ROLE='boss'"),
    ("BYTEPS_LOCAL_RANK", "3", "BYTEPS_LOCAL_RANK=3 must be < BYTEPS_LOCAL_SIZE=1"),
    ("BYTEPS_PARTITION_BYTES", "4k", "BYTEPS_PARTITION_BYTES='4k' is not an integer"),
    ("BYTEPS_TIMEOUT", "-5", "BYTEPS_TIMEOUT=-5 must be > 0"),
    ("BYTEPS_LOG_LEVEL", "LOUD", "BYTEPS_LOG_LEVEL='LOUD'"),
    ("BYTEPS_FORCE_DISTRIBUTED", "maybe", "BYTEPS_FORCE_DISTRIBUTED='maybe'"),
    ("DMLC_INTERFACE", "nonexistent0", "no such interface"),
    ("BYTEPS_SPIN_US", "fast", "BYTEPS_SPIN_US='fast' is not an integer"),
    ("BYTEPS_SPIN_US", "-1", "BYTEPS_SPIN_US=-1 must be >= 0"),
])
def test_malformed_variables_are_named(name, value, needle):
    env = dict(BASE, **{name: value})
    with pytest.raises(ConfigError) as e:
        config.load(env)
    assert needle in str(e.value)


@pytest.mark.parametrize("missing", ["DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT",
                                     "DMLC_WORKER_ID"])
def test_missing_variables_are_named(missing):
    env = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ConfigError, match=f"{missing} is not set"):
        config.load(env)


def test_spin_us_auto_follows_the_cpus_this_process_may_use(monkeypatch):
    """BYTEPS_SPIN_US: auto polls 50 us with 2 or more CPUs (200 us where the machine's worker processes
    outnumber them), never with one; a number is taken as is."""
    assert config.load(dict(BASE, BYTEPS_SPIN_US="0")).spin_us == 0
    assert config.load(dict(BASE, BYTEPS_SPIN_US="120")).spin_us == 120
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 1})
    assert config.load(BASE).spin_us == config.load(dict(BASE, BYTEPS_SPIN_US="auto")).spin_us == 50
    # the machine's worker processes outnumber its CPUs: poll longer (they wait for processes that share one)
    assert config.load(dict(BASE, BYTEPS_LOCAL_SIZE="4", BYTEPS_LOCAL_RANK="3")).spin_us == 200
    assert config.load(dict(BASE, BYTEPS_LOCAL_SIZE="2", BYTEPS_LOCAL_RANK="1")).spin_us == 50
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {3})
    assert config.load(BASE).spin_us == 0
    assert config.load(dict(BASE, BYTEPS_LOCAL_SIZE="4", BYTEPS_LOCAL_RANK="3")).spin_us == 0


def test_cpu_bind_values():
    assert config.load(BASE).cpu_bind == "auto"
    assert config.load(dict(BASE, BYTEPS_CPU_BIND="0")).cpu_bind == "0"
    with pytest.raises(ConfigError, match="BYTEPS_CPU_BIND='yes' must be one of auto, 1, 0"):
        config.load(dict(BASE, BYTEPS_CPU_BIND="yes"))


def test_scheduler_may_bind_any_port():
    cfg = config.load(dict(BASE, DMLC_ROLE="scheduler", DMLC_PS_ROOT_PORT="0"))
    assert cfg.root_port == 0


def test_every_variable_is_documented():
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "env.md")).read()
    for name in config.VARIABLES:
        assert f"`{name}`" in doc, f"{name} is missing from docs/env.md"
    for name in config.REMOVED:  # one data plane: nothing left to choose
        assert name not in doc, f"{name} chose between data planes that no longer exist"


BIND_CHILD = r"""
import json, os, sys, threading
from byteps import cpus
usable = sorted(os.sched_getaffinity(0))
ready, stop = threading.Event(), threading.Event()
before = threading.Thread(target=lambda: (ready.set(), stop.wait()))  # a thread started before binding
before.start()
ready.wait()
cpu = cpus.bind_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
later = []
after = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))  # started after
after.start()
after.join()
print(json.dumps({"cpu": cpu, "usable": usable, "caller": sorted(os.sched_getaffinity(0)),
                  "before": sorted(os.sched_getaffinity(before.native_id)), "after": later[0],
                  "usable_after": sorted(cpus.usable_cpus())}))
stop.set()
"""


@pytest.mark.parametrize("index,count,mode", [(3, 1, "auto"), (3, 99, "auto"), (1, 99, "0"), (1, 1, "1")])
def test_bind_worker_binds_the_training_thread_where_processes_fill_the_cpus(index, count, mode):
    """BYTEPS_CPU_BIND (byteps/cpus.py), in a child process: auto binds only where ``count`` (2 or
    more) is at least the number of usable CPUs, 1 always, 0 never. Bound, the calling thread and
    the threads it starts later run on the index-th CPU only; a thread started before (byteps' own)
    keeps every CPU; the process still reports the CPUs it could use before (BYTEPS_SPIN_US=auto is
    computed from them)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", BIND_CHILD, str(index), str(count), mode],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    got = json.loads(out)
    usable = got["usable"]
    bind = mode == "1" or (mode == "auto" and count >= max(2, len(usable)))
    if bind:
        assert got["cpu"] == usable[index % len(usable)]
        assert got["caller"] == got["after"] == [got["cpu"]], got
    else:
        assert got["cpu"] is None and got["caller"] == got["after"] == usable, got
    assert got["before"] == usable, got
    assert got["usable_after"] == usable


def test_removed_variables_warn_once_and_are_ignored():
    """A variable that chose between two data planes still set: one warning per process naming it and
    what happens now; the configuration is the one without it."""
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("byteps")
    log.addHandler(handler)
    try:
        config._warned_removed.clear()
        env = dict(BASE, **{name: "0" for name in config.REMOVED})
        assert config.load(env) == config.load(BASE)
        config.load(env)
    finally:
        log.removeHandler(handler)
    for name in config.REMOVED:
        assert sum(m.startswith(f"{name} no longer exists and is ignored") for m in seen) == 1, (name, seen)
        assert name not in config.VARIABLES
