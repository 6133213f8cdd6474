"""Barriers and shared arenas among the worker processes of one machine.

The GPU stages of a plan (core/gpu_stages.py) run in L independent processes (bpslaunch starts
them; nothing is forked from a common parent), so they cannot share ``multiprocessing`` primitives. :class:`LocalGroup` gives them:

* **shared memory**: every process owns one memfd arena (core/shm.py, never in /dev/shm, freed by
  the kernel when the last holder exits) and maps its peers' arenas through /proc/<pid>/fd/<fd>
  after a HELLO exchange, exactly as workers and servers share partitions;
* **barriers** over any subset of the local ranks, on Unix datagram sockets in the abstract
  namespace (``\\0byteps-local-<token>-<rank>``): a process sends its peers one datagram per
  barrier and waits for theirs. System calls order memory, so what a process wrote before
  sending is visible to a peer that received. Every barrier carries the operation's signature
  (byte count and dtype), so processes that call with different tensors fail with a message
  naming the ranks and what differs instead of summing garbage; every wait has a timeout that
  names the ranks that never arrived.
* **failure notices**: a barrier may carry a short error text (``error=``): every member then
  raises :class:`LocalPeerError` at that same barrier, so a failure in one process (its network
  step, say) ends the operation on all of them in step instead of leaving them to time out.

A datagram is accepted only from the address its sender rank must have bound (a name no one else
can bind while that rank holds it).
"""
import errno
import os
import socket
import struct
import time

from byteps.core import shm
from byteps.errors import BytePSError, BytePSTimeoutError, TensorMismatchError

MAGIC = b"BPLS"
HELLO, BARRIER = 1, 2
#: magic, kind, sender, sequence, phase, nbytes, dtype, tag | HELLO: pid, fd, inode, arena size;
#: BARRIER: an optional UTF-8 error text (at most ERROR_BYTES)
_MSG = struct.Struct("<4sIIQIQiQ")
_HELLO = struct.Struct("<iiQQ")
ERROR_BYTES = 400
_DATAGRAM = _MSG.size + ERROR_BYTES


class LocalPeerError(BytePSError):
    """A member of a barrier reported a failure (the text names the local rank and its error)."""

    def __init__(self, message, errors):
        super().__init__(message)
        self.errors = errors  #: {local rank: error text} as reported in the barrier


def _name(token, rank):
    return f"\0byteps-local-{token}-{rank}"


class LocalGroup:
    """The ``size`` local processes of one machine; this one is ``rank``.

    Args:
        token: a string all processes of the machine share and no other job uses
            (e.g. BYTEPS_JOB_ID + DMLC_WORKER_ID).
        rank, size: local rank and number of local processes.
        arena_bytes: size of this process's shared arena (peers may read and write it).
        timeout: seconds any wait (start-up, each barrier) may last.
    """

    def __init__(self, token, rank, size, arena_bytes, timeout=30.0):
        if not 0 <= rank < size:
            raise ValueError(f"local rank {rank} is outside 0..{size - 1}")
        self.token, self.rank, self.size, self.timeout = str(token), rank, size, float(timeout)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(_name(self.token, rank))
        except OSError as e:
            self.sock.close()
            if e.errno == errno.EADDRINUSE:
                raise RuntimeError(f"local rank {rank} of token {token!r} is already running on this machine "
                                   "(two processes with the same BYTEPS_LOCAL_RANK?)") from None
            raise
        self.arena = shm.Arena(arena_bytes, "byteps-local")
        self.maps = shm.PeerMaps()
        self.peers = {}  #: rank -> numpy uint8 view of that rank's arena (ours included)
        #: rank -> (pid, fd, inode) naming that rank's arena in a core/shm.py descriptor
        self.handles = {rank: (os.getpid(), self.arena.fd, self.arena.inode)}
        self._seen = {}  #: (seq, phase) -> {sender: (signature, error text or None)}
        self.peers[rank] = self.arena.array
        try:
            self._hello()
            # nobody leaves start-up before every peer has mapped its arena: a peer's memory can
            # only be opened (through /proc/<pid>/fd) while that peer is alive
            self.barrier(0, 0, range(size), what="start-up")
        except BaseException:
            self.close()
            raise

    # -- start-up --------------------------------------------------------------------------
    def _send(self, peer, payload):
        self.sock.sendto(payload, _name(self.token, peer))

    def _hello(self):
        me = _MSG.pack(MAGIC, HELLO, self.rank, 0, 0, 0, 0, 0) + _HELLO.pack(
            os.getpid(), self.arena.fd, self.arena.inode, self.arena.size)
        undelivered = set(range(self.size)) - {self.rank}
        deadline = time.monotonic() + self.timeout
        while undelivered or len(self.peers) < self.size:
            for peer in sorted(undelivered):
                try:
                    self._send(peer, me)
                    undelivered.discard(peer)
                except (ConnectionRefusedError, FileNotFoundError, BlockingIOError, socket.timeout):
                    pass  # not bound yet, or its queue is full: try again
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.size)) - set(self.peers) | undelivered)
                raise BytePSTimeoutError(f"local rank {self.rank}: local rank(s) {missing} of this machine did not "
                                         f"start within {self.timeout:g} s (token {self.token!r})")
            self._receive(min(0.05, left))

    def _receive(self, wait):
        """Read datagrams for up to ``wait`` seconds; record HELLOs and barrier arrivals."""
        self.sock.settimeout(max(wait, 1e-4))
        try:
            data, addr = self.sock.recvfrom(_DATAGRAM)
        except (socket.timeout, BlockingIOError):
            return
        if len(data) < _MSG.size:
            return
        magic, kind, sender, seq, phase, nbytes, dtype, tag = _MSG.unpack_from(data)
        if magic != MAGIC or sender >= self.size:
            return
        expected = _name(self.token, sender)
        if isinstance(addr, bytes):
            addr = addr.decode(errors="replace")
        if addr != expected:
            return  # not from the process that holds that rank's address
        if kind == HELLO and len(data) == _MSG.size + _HELLO.size:
            pid, fd, inode, size = _HELLO.unpack_from(data, _MSG.size)
            if sender not in self.peers:
                self.peers[sender] = self.maps.view(shm.DESCRIPTOR.pack(pid, fd, inode, 0, size))
                self.handles[sender] = (pid, fd, inode)
        elif kind == BARRIER:
            error = data[_MSG.size:].decode(errors="replace") or None
            self._seen.setdefault((seq, phase), {})[sender] = ((nbytes, dtype, tag), error)

    def locate(self, view):
        """The core/shm.py descriptor prefix (pid, fd, inode, offset) of a view into one of the
        machine's arenas (ours or a peer's), or None if it lies in none of them. Lets the engine hand
        a colocated server the executor's buffer itself instead of a copy."""
        addr = view.__array_interface__["data"][0]
        for rank, arr in self.peers.items():
            base = arr.__array_interface__["data"][0]
            if base <= addr and addr + view.nbytes <= base + arr.nbytes:
                pid, fd, inode = self.handles[rank]
                return pid, fd, inode, addr - base
        return None

    # -- barriers ------------------------------------------------------------------------
    def barrier(self, seq, phase, members, signature=(0, -1), what="barrier", error=None):
        """Wait until every rank in ``members`` reached (seq, phase); check their signatures agree.

        ``signature``: (nbytes, dtype) or (nbytes, dtype, tag) of the operation (tag: e.g. the
        tensor key, so two tensors of one size cannot be summed together). ``error``: a short text
        telling every member that this rank failed; then every member raises LocalPeerError here.
        """
        members = sorted(set(members))
        if self.rank not in members:
            raise ValueError(f"local rank {self.rank} is not in barrier members {members}")
        signature = _full(signature)
        note = b"" if error is None else str(error).encode()[:ERROR_BYTES]
        msg = _MSG.pack(MAGIC, BARRIER, self.rank, seq, phase, *signature) + note
        for peer in members:
            if peer != self.rank:
                self._send_reliably(peer, msg)
        deadline = time.monotonic() + self.timeout
        key = (seq, phase)
        while True:
            arrived = self._seen.get(key, {})
            missing = [r for r in members if r != self.rank and r not in arrived]
            if not missing:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise BytePSTimeoutError(f"local rank {self.rank}: {what} (operation {seq}) waited {self.timeout:g} s "
                                         f"for local rank(s) {missing}")
            self._receive(left)
        arrived = self._seen.pop(key, {})
        failed = {r: err for r, (_, err) in arrived.items() if err is not None}
        if error is not None:
            failed[self.rank] = str(error)
        if failed:
            detail = "; ".join(f"local rank {r}: {err}" for r, err in sorted(failed.items()))
            raise LocalPeerError(f"local rank {self.rank}: {what} (operation {seq}) ended by a failure on this "
                                 f"machine: {detail}", failed)
        differ = {r: sig for r, (sig, _) in arrived.items() if tuple(sig) != signature}
        if differ:
            from byteps.core import dtypes

            def show(sig):
                text = f"{sig[0]} bytes of {dtypes.name(sig[1]) if sig[1] in dtypes.INFO else sig[1]}"
                return text + (f" (tensor key {sig[2]})" if sig[2] else "")
            detail = "; ".join(f"local rank {r}: {show(s)}" for r, s in sorted(differ.items()))
            raise TensorMismatchError(f"local ranks disagree on operation {seq} ({what}): local rank {self.rank} has "
                                      f"{show(signature)}; {detail}")

    def _send_reliably(self, peer, msg):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._send(peer, msg)
                return
            except (BlockingIOError, socket.timeout):
                # the peer's queue is full (net.unix.max_dgram_qlen, often 10): keep draining our own
                # queue while we retry, so two processes sending to each other cannot both block
                if time.monotonic() > deadline:
                    raise BytePSTimeoutError(f"local rank {self.rank}: local rank {peer} stopped reading "
                                             f"for {self.timeout:g} s") from None
                self._receive(0.001)
            except (ConnectionRefusedError, FileNotFoundError):
                raise BytePSTimeoutError(f"local rank {self.rank}: local rank {peer} has gone away") from None

    def close(self):
        self.peers.clear()
        self.handles.clear()
        self.maps.close()
        try:
            self.sock.close()
        finally:
            arena, self.arena = self.arena, None
            if arena is not None:
                arena.array = None
                try:
                    arena.map.close()
                except BufferError:  # a view is still alive; the kernel frees it at exit
                    pass
                os.close(arena.fd)


def _full(signature):
    """(nbytes, dtype, tag) from a 2- or 3-tuple signature."""
    nbytes, dtype, *rest = signature
    return int(nbytes), int(dtype), int(rest[0]) if rest else 0
