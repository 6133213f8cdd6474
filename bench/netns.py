"""An emulated cluster on one Linux machine: hosts are network namespaces on one bridge, and each
host's link is limited to a rate B in both directions (tc tbf on both ends of its veth).

    from netns import Network
    with Network(["w0", "w1", "x0"], rate_mbit=200) as net:
        proc = net.popen("w0", [sys.executable, "train.py"], env={...})
        before = net.counters()        # {host: (tx_bytes, rx_bytes)} of each host's link
        net.link("w1", up=False)       # a network partition

Layout (nothing is created in the root namespace, so the machine's own interfaces, routes and
addresses are never touched, and every address used exists only inside these namespaces)::

    namespace <prefix>-sw:   br0 ── p0 ── p1 ── p2 ...       (bridge + the switch ends of the veths)
                                     │     │     │
    namespace <prefix>-w0:  eth0 10.200.0.1/24  (tbf: what w0 sends)      p0's tbf: what w0 receives
    namespace <prefix>-w1:  eth0 10.200.0.2/24
    ...

Each namespace has its own loopback (up), so processes of one host talk over ``lo`` without
crossing the rate limit, as on a real machine. Processes are started with ``ip netns exec`` in
their own session so that a whole tree can be signalled.

Cleanup is unconditional: leaving the ``with`` block (normally, on an exception, on Ctrl-C, or on
SIGTERM, which is turned into an exception while the network exists) kills every process started
here and every other process still inside one of the namespaces (``ip netns pids``), then deletes
the namespaces, which destroys the veths and the bridge with them. An ``atexit`` hook repeats it
if the interpreter exits another way, and :func:`remove_stale` deletes namespaces left behind by
a run that was SIGKILLed (names carry the creating pid; only dead creators' are touched).

Needs root (``ip netns``, veth, bridge and tbf); :func:`available` says whether they work here.
"""
import atexit
import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time

#: every namespace this module makes is named "<BASE><pid>-<random>-<host>"
BASE = "bpsn"
SUBNET = "10.200.0"
MTU = 9000  #: jumbo frames: TCP/IP headers are < 1% of the bytes, so link counters ~ payload


def _run(*argv, check=True, timeout=20):
    """Run a command; raise RuntimeError with its stderr if it fails (and `check`)."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(argv)} timed out after {timeout} s") from None
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def available():
    """None if namespaces, veths, bridges and tbf work here, else the reason they do not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} (iproute2) is not installed"
    try:
        with Network(["a", "b"], rate_mbit=1000):
            pass
    except (RuntimeError, OSError) as e:
        return f"cannot build a namespace network: {e}"
    return None


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces():
    res = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _kill_inside(ns):
    """SIGKILL every process inside namespace `ns` (only ours live there)."""
    res = _run("ip", "netns", "pids", ns, check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_stale():
    """Delete namespaces of this module whose creating process is gone (after a SIGKILL). Returns them."""
    removed = []
    for ns in _namespaces():
        m = re.match(rf"{BASE}(\d+)-", ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside(ns)
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed


class Network:
    """Hosts (namespaces) on one bridge with a per-host rate limit; a context manager.

    Args:
        hosts: short host names (letters, digits, ``_``; at most 12 characters).
        rate_mbit: each host's link rate in Mbit/s, applied to what it sends and what it receives.
        burst_bytes: tbf bucket size (default: 2 ms at the rate, at least 4 jumbo frames).
        queue_ms: how much data tbf may queue, in ms at the rate (beyond it, packets are dropped). The
            default, 500 ms, holds more than a byteps job keeps in flight towards one host, so nothing
            is dropped: with a short drop-tail queue a sparse flow (heartbeats) behind a saturated
            link loses segment after segment and TCP's retransmission back-off silences it for tens
            of seconds, which byteps rightly reports as a lost peer.
        mtu: link MTU (jumbo by default: byte counters then track the payload within ~1%).
    """

    def __init__(self, hosts, rate_mbit=None, burst_bytes=None, queue_ms=500, mtu=MTU):
        for h in hosts:
            if not re.fullmatch(r"[A-Za-z0-9_]{1,12}", h):
                raise ValueError(f"host name {h!r}: use 1-12 letters, digits or _")
        if len(set(hosts)) != len(hosts) or len(hosts) > 250:
            raise ValueError("host names must be unique (at most 250 hosts)")
        self.names = list(hosts)
        self.rate_mbit = rate_mbit
        self.burst = burst_bytes
        self.queue_ms = queue_ms
        self.mtu = mtu
        self.prefix = f"{BASE}{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{self.prefix}-sw"
        self.ns = {h: f"{self.prefix}-{h}" for h in hosts}
        self.addr = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(hosts)}
        self.port_of = {h: f"p{i}" for i, h in enumerate(hosts)}  # switch-side veth of each host
        self.procs = []
        self._made = []
        self._closed = False
        self._old_term = None

    # ------------------------------------------------------------------------- lifetime

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        atexit.register(self.close)
        try:
            remove_stale()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @staticmethod
    def _on_sigterm(signum, frame):
        raise SystemExit(128 + signum)  # unwinds through __exit__, which cleans up

    def _ns_add(self, ns):
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _build(self):
        self._ns_add(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for h in self.names:
            ns, port = self.ns[h], self.port_of[h]
            self._ns_add(ns)
            # created inside the switch namespace with its peer directly in the host's: never in ours
            _run("ip", "-n", self.switch, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            if self.rate_mbit:
                self._tbf(ns, "eth0")           # what the host sends
                self._tbf(self.switch, port)    # what the host receives
        self._wait_reachable()

    def _tbf(self, ns, dev):
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = self.burst or max(4 * self.mtu, int(rate_bytes * 0.002))
        limit = max(4 * burst, int(rate_bytes * self.queue_ms / 1000))
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "limit", str(limit))

    def _wait_reachable(self, timeout=10):
        """The bridge forwards only once its ports are in the forwarding state; wait for that."""
        deadline = time.monotonic() + timeout
        while True:
            res = _run("bridge", "-n", self.switch, "-j", "link", "show", check=False)
            try:
                states = {p.get("ifname"): p.get("state") for p in json.loads(res.stdout or "[]")}
            except ValueError:
                states = {}
            if all(states.get(port) == "forwarding" for port in self.port_of.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"bridge ports not forwarding after {timeout} s: {states}")
            time.sleep(0.05)

    def close(self):
        """Kill every process started here or still inside our namespaces, then delete them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for p in self.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except (ProcessLookupError, PermissionError):
                        pass
            deadline = time.monotonic() + 3
            for p in self.procs:
                try:
                    p.wait(max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            for ns in self._made:
                _kill_inside(ns)
            for p in self.procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for ns in reversed(self._made):
                _run("ip", "netns", "del", ns, check=False)
            self._made = []
            if self._old_term is not None:
                try:
                    signal.signal(signal.SIGTERM, self._old_term)
                except ValueError:  # not the main thread (atexit from elsewhere)
                    pass
            atexit.unregister(self.close)

    # ------------------------------------------------------------------------- using it

    def popen(self, host, argv, env=None, **kwargs):
        """Start `argv` inside `host`'s namespace (own session: killed as a group at close)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], env=env, start_new_session=True,
                             **kwargs)
        self.procs.append(p)
        return p

    def run(self, host, argv, timeout=20):
        """Run a short command inside `host` and return its CompletedProcess (text output)."""
        return _run("ip", "netns", "exec", self.ns[host], *argv, check=False, timeout=timeout)

    def counters(self):
        """{host: (tx_bytes, rx_bytes)} of each host's eth0, whole frames as the kernel counts them."""
        out = {}
        for h in self.names:
            res = _run("ip", "-n", self.ns[h], "-s", "-j", "link", "show", "dev", "eth0")
            stats = json.loads(res.stdout)[0]["stats64"]
            out[h] = (stats["tx"]["bytes"], stats["rx"]["bytes"])
        return out

    def link(self, host, up):
        """Take `host`'s link down (a network partition) or bring it back up."""
        _run("ip", "-n", self.ns[host], "link", "set", "eth0", "up" if up else "down")

    def exists(self):
        """Names of our namespaces that still exist (empty after close)."""
        have = set(_namespaces())
        return [ns for ns in [self.switch, *self.ns.values()] if ns in have]
