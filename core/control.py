"""The control-plane client every server and worker holds: register, heartbeats, scheduler liveness.

The owner's event loop polls :attr:`ControlClient.sock` together with its other sockets and
calls :meth:`tick` at least every heartbeat interval; nothing here starts a thread.
"""
import os
import socket
import time

import zmq

from byteps import timeline
from byteps.errors import PeerLostError, ProtocolError

from . import auth, wire


class ControlClient:
    """A DEALER connection to the scheduler."""

    def __init__(self, ctx, cfg, info):
        self.cfg = cfg
        self.info = dict(info, pid=os.getpid(), hostname=socket.gethostname(), job_id=cfg.job_id,
                         enable_async=cfg.enable_async)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.identity = auth.new_identity()
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.connect(cfg.scheduler_endpoint)
        self.secret = auth.job_secret()
        self._knock = auth.Knock(self.secret, self.identity) if self.secret else None
        self.node_id = wire.NO_SENDER
        self._last_sent = 0.0
        self._last_heard = time.monotonic()
        self._heard_once = False

    def send(self, cmd, body=None, key=0, arg=0):
        self.sock.send_multipart(wire.control(cmd, self.node_id, body, key=key, arg=arg))
        self._last_sent = time.monotonic()

    def register(self):
        """Register with the scheduler; with a job secret, first prove it (see core/auth.py)."""
        if self._knock is None:
            self.send(wire.Cmd.REGISTER, self.info)
        else:
            self.send(wire.Cmd.HELLO, self._knock.hello())

    def on_challenge(self, body):
        """The scheduler's CHALLENGE: check its proof, then register with our MAC."""
        if self._knock is None:
            raise ProtocolError("the scheduler sent a CHALLENGE but this node has no BYTEPS_JOB_SECRET")
        try:
            mac = self._knock.answer(body, f"the scheduler at {self.cfg.scheduler_endpoint}")
        except auth.AuthError as e:
            raise PeerLostError(str(e)) from None
        self.send(wire.Cmd.REGISTER, dict(self.info, auth=mac))

    def recv(self):
        """Receive one control message (call when the socket is readable): (header, body dict)."""
        frames = self.sock.recv_multipart()
        arrived = time.monotonic_ns()
        self._last_heard = time.monotonic()
        self._heard_once = True
        if len(frames) != 2:
            raise ProtocolError(f"control message from the scheduler has {len(frames)} frames, expected 2")
        header, body = wire.unpack(frames[0]), wire.decode(frames[1])
        if header.cmd == wire.Cmd.CLOCK and timeline.recorder is not None:  # the caller ignores it
            timeline.recorder.clock.on_reply(body, arrived)
        return header, body

    def beat(self):
        """Send a heartbeat if one is due. Long bursts of work call this between items: the silence
        check (tick) must wait until we have read what the scheduler sent meanwhile."""
        if time.monotonic() - self._last_sent >= self.cfg.heartbeat_interval:
            self.send(wire.Cmd.HEARTBEAT)

    def tick(self):
        """Send a heartbeat when due; raise PeerLostError if the scheduler has gone silent."""
        self.beat()
        now = time.monotonic()
        if timeline.recorder is not None and self.node_id != wire.NO_SENDER:  # registered: the scheduler answers
            timeline.probe_clock(self)
        silent = now - self._last_heard
        # a message waiting unread means the silence was ours (a process frozen with SIGSTOP and resumed:
        # ZeroMQ's I/O thread may need a moment to read what the kernel kept): the caller reads it next
        # (it may be the scheduler's TERMINATE with the reason)
        if (self._heard_once and silent > self.cfg.heartbeat_timeout
                and not self.sock.poll(int(min(self.cfg.heartbeat_interval, 1.0) * 1000))):
            raise PeerLostError(f"lost the scheduler at {self.cfg.scheduler_endpoint}: no message for {silent:.1f} s "
                                f"(BYTEPS_HEARTBEAT_TIMEOUT={self.cfg.heartbeat_timeout:g})")
        if not self._heard_once and silent > self.cfg.timeout:
            raise PeerLostError(f"the scheduler at {self.cfg.scheduler_endpoint} did not answer within "
                                f"{self.cfg.timeout:g} s (BYTEPS_TIMEOUT); is it running, and are DMLC_PS_ROOT_URI/"
                                "DMLC_PS_ROOT_PORT right?")

    def close(self):
        self.sock.close(linger=500)


def describe_node(node):
    """Human-readable name of a node from an address-book entry ("worker rank 1 (pid 42 on host)")."""
    where = f"pid {node.get('pid')} on {node.get('hostname', node.get('host'))}"
    if node.get("role") == "server":
        return f"server {node.get('index')} ({node.get('host')}:{node.get('port')}, {where})"
    return f"worker rank {node.get('rank')} (DMLC_WORKER_ID={node.get('worker_id')}, " \
           f"local rank {node.get('local_rank')}, {where})"
