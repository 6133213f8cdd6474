"""Shared memory between processes of one machine: memfd arenas and the descriptors that name them.

Colocated workers and servers exchange partitions through shared memory instead of TCP loopback
(the paper's "+shm" path, §6.2). Memory comes from ``memfd_create`` arenas: anonymous files that
never appear in /dev/shm and that the kernel frees when the last process holding them exits, so a
crash cannot leak a segment. A peer opens an arena through ``/proc/<pid>/fd/<fd>``; a probe (a
small arena holding a random nonce) proves first that both processes share one kernel and may
open each other's descriptors, otherwise traffic stays on TCP.

A region is named on the wire by a 32-byte :data:`DESCRIPTOR`: (pid, fd, inode, offset, length).
The inode tells arenas apart when a process closes one and a later one gets the same fd number
(shutdown() then init() again); a mapping is used only if the inode still matches.
"""
import mmap
import os
import secrets
import struct

import numpy as np

from byteps.errors import ProtocolError

PAGE = mmap.PAGESIZE
ARENA_BYTES = 64 << 20
DESCRIPTOR = struct.Struct("<iiQQQ")


def boot_id():
    """Identifies this kernel's boot: processes with equal boot ids may share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def supported():
    return hasattr(os, "memfd_create") and boot_id() is not None


class Arena:
    """One memfd, mapped read-write, handed out in page-aligned pieces by a bump allocator."""

    def __init__(self, nbytes, name="byteps"):
        self.size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.inode = os.fstat(self.fd).st_ino
        self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.used = 0

    def take(self, nbytes):
        """Offset of a fresh page-aligned region of nbytes, or None if it does not fit."""
        start = self.used
        end = start + max(PAGE, -(-nbytes // PAGE) * PAGE)
        if end > self.size:
            return None
        self.used = end
        return start


class Allocator:
    """Page-aligned shared buffers from a growing list of arenas (nothing is freed before close)."""

    def __init__(self, name="byteps", arena_bytes=ARENA_BYTES):
        self.name = name
        self.arena_bytes = arena_bytes
        self.arenas = []
        self.pid = os.getpid()

    def alloc(self, nbytes):
        """(numpy uint8 view, descriptor prefix (pid, fd, inode, offset)) of a new region, its pages
        already faulted in (see :func:`prefault`)."""
        for arena in self.arenas:
            off = arena.take(nbytes)
            if off is not None:
                break
        else:
            arena = Arena(max(nbytes, self.arena_bytes), self.name)
            self.arenas.append(arena)
            off = arena.take(nbytes)
        prefault(arena.map, off, nbytes)
        return arena.array[off:off + nbytes], (self.pid, arena.fd, arena.inode, off)

    def reset(self):
        """Reuse every arena from the start (the caller guarantees no region is in use)."""
        for arena in self.arenas:
            arena.used = 0

    def close(self):
        for arena in self.arenas:
            arena.array = None
            try:
                arena.map.close()
            except BufferError:  # a view is still alive somewhere; the kernel frees it at exit
                pass
            os.close(arena.fd)
        self.arenas = []


#: madvise(2) MADV_POPULATE_WRITE (Linux 5.14); Python 3.11's mmap module does not name it
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def prefault(mapping, offset, nbytes):
    """Fault the pages of ``mapping[offset:offset + nbytes]`` in with one system call, at the region's
    allocation (once per key) rather than page by page in the first push_pull's copy (shared memory
    gets no transparent huge pages). Best effort: older kernels fault on first touch."""
    if nbytes <= 0 or not hasattr(mapping, "madvise"):
        return
    try:
        mapping.madvise(MADV_POPULATE_WRITE, offset, -(-nbytes // PAGE) * PAGE)
    except (OSError, ValueError):
        pass


def describe(prefix, nbytes):
    pid, fd, inode, off = prefix
    return DESCRIPTOR.pack(pid, fd, inode, off, nbytes)


class PeerMaps:
    """Mappings of other processes' arenas, opened once through /proc/<pid>/fd/<fd>."""

    def __init__(self):
        self.maps = {}

    def view(self, body):
        """The region a descriptor names, as a writable uint8 numpy view; ProtocolError if invalid."""
        if len(body) != DESCRIPTOR.size:
            raise ProtocolError(f"shared-memory descriptor of {len(body)} bytes, expected {DESCRIPTOR.size}")
        pid, fd, inode, off, nbytes = DESCRIPTOR.unpack(body)
        arr = self.maps.get((pid, fd, inode))
        if arr is None:
            arr = self._open(pid, fd, inode)
        if off + nbytes > arr.size:
            raise ProtocolError(f"shared-memory region {off}+{nbytes} is outside arena {pid}/{fd} "
                                f"of {arr.size} bytes")
        return arr[off:off + nbytes]

    def _open(self, pid, fd, inode):
        path = f"/proc/{pid}/fd/{fd}"
        try:  # the texts match core/transport/bps_wire.h open_arena's (tests/test_native_server.py)
            target = os.readlink(path)
            # only byteps's own memfd arenas: a descriptor must not map any file the peer has open
            if not target.startswith("/memfd:byteps"):
                raise ProtocolError(f"fd {fd} of pid {pid} is {target!r}, not a byteps shared-memory arena")
            f = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ProtocolError(f"cannot open shared memory of pid {pid} (fd {fd}): {e}") from None
        try:
            st = os.fstat(f)
            if st.st_ino != inode:
                raise ProtocolError(f"shared memory of pid {pid} (fd {fd}) is no longer the arena named "
                                    f"(inode {st.st_ino}, expected {inode})")
            m = mmap.mmap(f, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:  # not mappable: empty, a device, read-only
            raise ProtocolError(f"shared memory of pid {pid} (fd {fd}) cannot be mapped: {e}") from None
        finally:
            os.close(f)
        arr = np.frombuffer(m, dtype=np.uint8)
        self.maps[(pid, fd, inode)] = arr
        return arr

    def close(self):
        self.maps.clear()


def ring_region(nbytes):
    """A memfd of ``nbytes`` for a local link's shared-memory rings (core/transport/bps_link.h BpsShmLink): (fd,
    what the peer needs to open it: {"pid", "fd", "inode"}). The caller closes the fd once both ends
    mapped it; the kernel frees it with the last mapping."""
    fd = os.memfd_create("byteps-ring", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, {"pid": os.getpid(), "fd": fd, "inode": os.fstat(fd).st_ino}
    except OSError:
        os.close(fd)
        raise


def open_ring(info, nbytes):
    """Open a peer's ring_region() from its info: our fd (the caller closes it once mapped).
    ProtocolError if it is not a byteps ring of at least ``nbytes`` on this kernel."""
    try:
        pid, fd, inode = int(info["pid"]), int(info["fd"]), int(info["inode"])
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"malformed shared-memory ring offer {info!r}") from None
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith("/memfd:byteps-ring"):
            raise ProtocolError(f"fd {fd} of pid {pid} is not a byteps shared-memory ring")
        f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise ProtocolError(f"cannot open the shared-memory ring of pid {pid} (fd {fd}): {e}") from None
    st = os.fstat(f)
    if st.st_ino != inode or st.st_size < nbytes:
        os.close(f)
        raise ProtocolError(f"the shared-memory ring of pid {pid} (fd {fd}) is not the one offered (inode "
                            f"{st.st_ino}, {st.st_size} bytes; expected inode {inode}, {nbytes} bytes)")
    return f


class Probe:
    """A one-page arena holding a nonce: a peer that can read it back may use our shared memory."""

    def __init__(self):
        self.nonce = secrets.token_hex(16)
        self.arena = Arena(PAGE, "byteps-probe")
        data = self.nonce.encode()
        self.arena.array[:len(data)] = np.frombuffer(data, dtype=np.uint8)

    def info(self):
        return {"boot_id": boot_id(), "pid": os.getpid(), "fd": self.arena.fd, "inode": self.arena.inode,
                "nonce": self.nonce}


def can_share(info, maps):
    """True if the process described by a Probe's info() is on this kernel and its memory opens."""
    if not info or not supported() or info.get("boot_id") != boot_id():
        return False
    nonce = info["nonce"].encode()
    try:
        view = maps.view(DESCRIPTOR.pack(info["pid"], info["fd"], info["inode"], 0, len(nonce)))
    except ProtocolError:
        return False
    return view.tobytes() == nonce
