"""The versioned wire header every byteps message starts with, and the control-message codec.

Every message is a ZeroMQ multipart message ``[header, body]`` (a ROUTER socket adds the
peer identity in front). The header is a fixed 40-byte little-endian struct:

====== ====== ===========================================================
offset type   field
====== ====== ===========================================================
0      2s     magic ``b"BP"``
2      u8     version (:data:`VERSION`)
3      u8     command (:class:`Cmd`)
4      u8     dtype code (core/dtypes.py), 255 if none
5      u8     flags: :data:`FLAG_SHM` = the body is a shared-memory descriptor (core/shm.py);
              :data:`FLAG_COMPRESSED` = the body is a compressed partition (byteps/compression.py);
              :data:`FLAG_ABANDON` = the sender refused the call of this round, the body says why
6      u16    reserved, 0
8      u32    sender: the node id the scheduler assigned (0xFFFFFFFF before assignment)
12     u32    arg: command argument (root rank for BROADCAST, error code, ...)
16     u64    key: tensor key << 32 | partition index (0 for control messages)
24     u64    round: per-key iteration number, so rounds of one key never mix
32     u64    length: byte length of the body that follows
====== ====== ===========================================================

Data bodies are raw tensor bytes (never pickled), or, with :data:`FLAG_SHM` between processes of
one machine, a 24-byte descriptor of a shared-memory region holding them (``length`` is then
the region's size). Control bodies are UTF-8 JSON objects.
:func:`unpack` checks every field and bounds every length before anything is allocated.
"""
import enum
import json
import struct

from byteps.errors import ProtocolError

MAGIC = b"BP"
VERSION = 1
HEADER = struct.Struct("<2sBBBBHIIQQQ")
HEADER_SIZE = HEADER.size
NO_SENDER = 0xFFFFFFFF
NO_DTYPE = 255
#: largest body accepted in one message (a partition is at most BYTEPS_PARTITION_BYTES)
MAX_BODY = 1 << 33
#: largest control (JSON) body accepted
MAX_CONTROL_BODY = 16 << 20
#: flag: the body is a shared-memory descriptor, not the data
FLAG_SHM = 1
#: flag: the body is a compressed partition (byteps/compression.py); ``length`` stays the dense byte count
FLAG_COMPRESSED = 2
#: flag (PUSHPULL, BROADCAST, LOCAL_READY): the sender refused the call this round belongs to; the body is
#: the UTF-8 reason. The server fails the round for every pusher of it with the reason; the key's next
#: round is normal (core/engine.py abandon, summation/native/sync_rounds.h abandon)
FLAG_ABANDON = 4
#: flag (LOCAL_READY): the sender has seen an odd number of join()s end. Rounds restart at 0 when a join
#: ends, and the end reaches a machine's processes at different moments: a process still in join() must not
#: adopt a copy its peer sent for the first op after the end (core/engine.py _on_local)
FLAG_JOIN_EPOCH = 8


class Cmd(enum.IntEnum):
    # control plane: node <-> scheduler
    REGISTER = 1       # node -> scheduler: who I am, where my data port is
    ADDRBOOK = 2       # scheduler -> node: ids, ranks and addresses of every node
    BARRIER = 3        # node -> scheduler, and the release back
    DECLARE = 4        # worker -> scheduler: tensor name, shape, dtype; reply: key or mismatch error
    HEARTBEAT = 5      # both directions
    LEAVE = 6          # worker -> scheduler: shutdown() of this worker (an epoch ends)
    EXIT = 7           # worker -> scheduler: the worker process is exiting
    ABORT = 8          # scheduler -> node: the job failed (body names the lost peer / reason)
    TERMINATE = 9      # scheduler -> server: the job is complete, exit 0
    JOIN = 10          # worker -> scheduler: join(); scheduler -> all: who has joined / the release
    CLOCK = 14         # node -> scheduler: {t0}; reply {t0, t1, t2}: a timestamped round trip (byteps/timeline)
    TRACE = 15         # node -> scheduler: a batch of timeline spans; scheduler -> node: {start: path}
    # authentication handshake on every connection (core/auth.py)
    HELLO = 11         # client -> server: {nonce}
    CHALLENGE = 12     # server -> client: {nonce, proof}
    AUTH = 13          # client -> server (data and local planes): {mac}
    # data plane: worker <-> server
    PUSHPULL = 20      # worker -> server: this round's partition; reply: the sum
    BROADCAST = 21     # worker -> server: root sends data, others an empty body; reply: root's data
    REPLY = 22         # server -> worker: the result of PUSHPULL / BROADCAST
    ERROR = 23         # either direction: body is a JSON {"error": msg}
    # local plane: worker processes of one machine (core/local.py)
    LOCAL_READY = 24   # -> partition owner: my copy is in shared memory here (FLAG_SHM descriptor)
    LOCAL_DONE = 25    # owner -> others: the machine's result is in shared memory here
    ASYNC_PUSHPULL = 26  # worker -> server (BYTEPS_ENABLE_ASYNC): round 0 the parameters, then a delta;
                         # reply: the server's latest parameters (docs/async.md)
    PROBE = 27         # worker -> server: any bytes, echoed back (byteps/autotune.py times the link with it)
    LINK = 28          # worker -> server (authenticated, over ZeroMQ): may I open a direct link? reply:
                       # LINK {port, token} or {error}; first on the new link: LINK with token + identity,
                       # answered by LINK arg 1 (accepted) or 0 (core/transport/bps_link.h). Local plane: a
                       # higher local rank offers a lower one LINK {port, token, local_rank} (_open_local_links)
    # elastic servers (docs/elastic.md): the scheduler's membership change, in two steps
    MEMBERS = 29       # scheduler -> worker: {phase: "prepare"|"commit", members, servers, dead, ...}, or to a
                       # worker still in init(): {phase: "lost", server, reason} (stop waiting for it);
                       # worker -> scheduler: {phase: "prepared", members, counts}; scheduler -> server: notice
    SUSPECT = 30       # worker -> scheduler: {server: index}: my direct link to that server broke
    RESULT = 31        # worker -> a lost server's replacement: the result of (key, round) that the lost
                       # server sent this worker before it went (others may not have it: docs/elastic.md)
    NCCL_ID = 32       # local rank 0 -> the machine's others: its NCCL unique id (core/pipeline/nccl_stages.h)
    NCCL_READY = 33    # -> local rank 0: a partition's collective (its stage in ``length``) is ready here
    NCCL_ORDER = 34    # local rank 0 -> the others: the next collective in the machine's order
    NCCL_ABORT = 35    # -> the machine's others: the NCCL stages stopped here; body: why


_CMDS = frozenset(int(c) for c in Cmd)
_DATA_CMDS = frozenset({Cmd.PUSHPULL, Cmd.BROADCAST, Cmd.REPLY, Cmd.LOCAL_READY, Cmd.LOCAL_DONE, Cmd.ASYNC_PUSHPULL,
                        Cmd.PROBE, Cmd.RESULT})


def pack(cmd, sender=NO_SENDER, key=0, round=0, length=0, dtype=NO_DTYPE, arg=0, flags=0):
    """Build a header."""
    return HEADER.pack(MAGIC, VERSION, int(cmd), dtype, flags, 0, sender, arg, key, round, length)


class Header:
    """A parsed header (plain attributes, built only by :func:`unpack`)."""

    __slots__ = ("cmd", "dtype", "flags", "sender", "arg", "key", "round", "length")

    def __repr__(self):
        return (f"Header({Cmd(self.cmd).name}, sender={self.sender}, key={self.key:#x}, round={self.round}, "
                f"len={self.length}, dtype={self.dtype}, arg={self.arg})")


def unpack(buf):
    """Parse and validate a header frame; raise ProtocolError on anything malformed."""
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(f"header frame is {len(buf)} bytes, expected {HEADER_SIZE}")
    magic, version, cmd, dtype, flags, _, sender, arg, key, rnd, length = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a byteps message")
    if version != VERSION:
        raise ProtocolError(f"wire version {version} is not supported (this build speaks {VERSION})")
    if cmd not in _CMDS:
        raise ProtocolError(f"unknown command {cmd}")
    limit = MAX_BODY if cmd in _DATA_CMDS else MAX_CONTROL_BODY
    if length > limit:
        raise ProtocolError(f"{Cmd(cmd).name} body length {length} exceeds the limit {limit}")
    h = Header()
    h.cmd, h.dtype, h.flags, h.sender, h.arg, h.key, h.round, h.length = cmd, dtype, flags, sender, arg, key, rnd, length
    return h


def encode(obj):
    """Control body: compact JSON bytes."""
    return json.dumps(obj, separators=(",", ":")).encode()


def decode(body):
    """Parse a control body; it must be a JSON object."""
    if len(body) > MAX_CONTROL_BODY:
        raise ProtocolError(f"control body of {len(body)} bytes exceeds {MAX_CONTROL_BODY}")
    try:
        obj = json.loads(bytes(body).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"control body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("control body is not a JSON object")
    return obj


def control(cmd, sender=NO_SENDER, body=None, key=0, arg=0):
    """A complete control message as a list of frames: [header, json body]."""
    payload = encode(body or {})
    return [pack(cmd, sender=sender, key=key, arg=arg, length=len(payload)), payload]


def make_key(tensor_key, partition):
    return (tensor_key << 32) | partition


#: a partition index's low bits number the piece; the bits above name the server membership it belongs
#: to (elastic servers, docs/elastic.md), so a membership's keys are new to every server
MEMBERS_SHIFT = 24


def member_partition(partition, members):
    """Partition index of piece ``partition`` in server membership ``members`` (0: the job's first)."""
    if partition >> MEMBERS_SHIFT or members >> (32 - MEMBERS_SHIFT):
        raise ValueError(f"partition {partition} of membership {members} does not fit a wire key")
    return partition | (members << MEMBERS_SHIFT)


def split_key(key):
    return key >> 32, key & 0xFFFFFFFF
