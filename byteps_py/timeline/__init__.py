"""One merged timeline for the whole job (``BYTEPS_TIMELINE=PATH``; docs/timeline.md).

Every worker and server records spans (one stage of one partition on one thread) into the native
cores' bounded buffers (core/pipeline/bps_trace.h); this module's :class:`Recorder` empties them, adds
the step marks, and sends them to the scheduler with this node's clock offset (:class:`Clock`); the
scheduler writes one Chrome/Perfetto JSON file (trace.py).
"""
import collections
import os
import threading
import time

from .spans import encode, pack

#: the process's recorder while tracing, else None
recorder = None
#: steps this process has marked (mark_step)
steps = 0
#: spans per TRACE message (a control message body is at most 16 MiB of JSON; 86 bytes a span)
CHUNK_SPANS = 100000
#: clock probes sent back to back at start, before the estimate is first used
BURST = 8


class Clock:
    """This node's offset to the scheduler's clock from timestamped round trips (NTP's rule; docs/timeline.md,
    "One clock"): of the recent probes, the one with the shortest round trip gives the estimate."""

    def __init__(self, interval):
        self.interval = interval
        self.samples = collections.deque(maxlen=16)  # (round trip, offset, error bound), ns
        self._last = 0.0
        self._sent = 0

    def due(self):
        now = time.monotonic()
        gap = 0.005 if self._sent < BURST else self.interval
        if now - self._last < gap:
            return False
        self._last = now
        self._sent += 1
        return True

    def on_reply(self, body, t3):
        t0, t1, t2 = int(body["t0"]), int(body["t1"]), int(body["t2"])
        rtt = (t3 - t0) - (t2 - t1)
        if rtt < 0:
            return
        self.samples.append((rtt, ((t1 - t0) + (t2 - t3)) // 2, rtt // 2))

    def estimate(self):
        """{offset_ns, error_ns, samples}: add offset_ns to our time to get the scheduler's."""
        if not self.samples:
            return {"offset_ns": 0, "error_ns": None, "samples": 0}
        rtt, offset, err = min(self.samples)
        return {"offset_ns": offset, "error_ns": err, "samples": len(self.samples)}


class Recorder:
    """This process's step marks and the native span buffers it empties when it sends."""

    def __init__(self, capacity, flush_steps, clock_interval, path=""):
        self.capacity = capacity
        self.flush_steps = flush_steps
        self.path = path            # set on the node that asked for it (start_timeline); the scheduler's wins
        self.marks = []             # (step, t_ns, tid)
        self.keys = {}              # tensor key -> name (workers; servers only see keys)
        self.node = {"pid": os.getpid()}
        self.native = []            # addresses of native span buffers (core/_trace.pyx)
        self.clock = Clock(clock_interval)
        self.thread_names = {}      # tid -> name, kept after the thread ends (its spans are sent later)
        self.flush_due = False
        self.wake = None            # wakes the thread that sends (the worker's engine thread)
        self.last_sent = time.monotonic()
        self.stopped = False
        self._lock = threading.Lock()

    def add_native(self, address):
        from byteps.core import _trace

        if address not in self.native:
            _trace.enable(address, self.capacity)
            self.native.append(address)

    def remember_threads(self):
        """Note the names of this process's live threads (the native ones are gone by the final send)."""
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    self.thread_names[int(tid)] = f.read().strip()
            except OSError:  # it has just ended
                pass

    def mark_step(self, step):
        if self.stopped:
            return
        self.marks.append((step, time.monotonic_ns(), threading.get_native_id()))
        if self.flush_steps and step % self.flush_steps == 0:
            self.flush_due = True
            if self.wake is not None:  # the owner thread may sleep in its poll: send now, not next tick
                self.wake()

    def chunks(self, final=False):
        """The TRACE bodies that carry everything recorded since the last call."""
        from byteps.core import _trace

        with self._lock:
            raws, dropped = [], 0
            for address in self.native:
                raw, lost = _trace.drain(address)
                raws.append(raw)
                dropped += lost
            spans = pack(raws)
            marks, self.marks = self.marks, []
            self.flush_due = False
        self.remember_threads()
        tids = set(spans["tid"].tolist()) | {m[2] for m in marks}
        threads = {tid: self.thread_names.get(tid, f"thread {tid}") for tid in tids}
        head = {"node": self.node, "clock": self.clock.estimate(), "threads": threads, "keys": self.keys,
                "dropped": dropped, "marks": marks, "path": self.path}
        out = []
        for i in range(0, max(len(spans), 1), CHUNK_SPANS):
            out.append(dict(head, spans=encode(spans[i:i + CHUNK_SPANS]), final=False))
            head = dict(head, marks=[], dropped=0, keys={})
        out[-1]["final"] = final
        return out

    def send(self, control, final=False):
        """Send what is held to the scheduler on ``control`` (core/control.py), from its owner thread."""
        from byteps.core.wire import Cmd

        self.last_sent = time.monotonic()
        for body in self.chunks(final):
            control.send(Cmd.TRACE, body)


def start(cfg, path=""):
    """Start recording in this process (BYTEPS_TIMELINE, or start_timeline()); returns the recorder."""
    global recorder
    if recorder is None:
        recorder = Recorder(cfg.timeline_buffer, cfg.timeline_flush_steps, cfg.timeline_clock_interval, path)
    return recorder


def stop():
    """Stop recording now; what was recorded is sent by the next flush (the owner thread's)."""
    r = recorder
    if r is not None:
        from byteps.core import _trace

        r.stopped = True
        for address in r.native:
            _trace.enable(address, 0)
        r.flush_due = True


def mark_step():
    """Mark the end of a training step on this worker (the optimizers call it; users may too).
    Steps are counted whether or not tracing is on, so a trace started late numbers them right."""
    global steps
    steps += 1
    r = recorder
    if r is not None:
        r.mark_step(steps)


def flush(control, final=False):
    """Send the spans to the scheduler if a flush is due (every N steps, stop_timeline()) or ``final``;
    called by each node's control-plane owner (the worker's engine thread, the server's loop)."""
    global recorder
    r = recorder
    if r is None or not (final or r.flush_due):
        return
    r.send(control, final or r.stopped)
    if r.stopped:
        recorder = None


def probe_clock(control):
    """Send a clock probe (Cmd.CLOCK) when one is due; ControlClient.tick calls this."""
    r = recorder
    if r is not None and r.clock.due():
        from byteps.core.wire import Cmd

        r.remember_threads()  # now and then: short-lived threads are gone by the final send
        control.send(Cmd.CLOCK, {"t0": time.monotonic_ns()})


def remember_threads():
    """Note thread names now: the engines call this before their native threads stop."""
    r = recorder
    if r is not None:
        r.remember_threads()
