"""Summation Service server event loop.

Data plane: one ROUTER socket on DMLC_NODE_HOST (random port, announced to the scheduler).
A worker sends ``[header PUSHPULL(key, round), partition bytes]``; the server

* receives the first push of a round straight into the key's store (``recv_into``: the one
  unavoidable copy, from the socket into page-aligned memory),
* sums every later push into it from ZeroMQ's own message buffer (``sum_into``, a Cython
  ``nogil`` kernel; no intermediate copy),
* answers all workers of the round with the store, zero-copy, once every worker has pushed.

Each key has two stores used by alternate rounds: a worker can push round r+1 as soon as it
has the reply of round r, while ZeroMQ may still be sending round r's replies to the others
from the other store. Round r+2 cannot start before every worker has received round r.

A push of the wrong round, a duplicate, or a length/dtype that differs from the round's first
push fails that round for every worker of it (each gets an ERROR naming the ranks and values),
so no worker waits forever and no bytes are silently truncated.
"""
import sys
import time

import zmq

from byteps import config as bps_config
from byteps.core import dtypes, wire
from byteps.core._reduce import aligned_empty, sum_into
from byteps.core.control import ControlClient
from byteps.errors import BytePSError, ConfigError, PeerLostError, ProtocolError
from byteps.log import logger, setup as setup_logging

Cmd = wire.Cmd
#: log a stall warning when a round has waited this long for its last pushes
STALL_WARNING_S = 60.0


class _Round:
    """State of one key: the current round's arrivals and the two stores."""

    __slots__ = ("round", "nbytes", "dtype", "stores", "senders", "waiters", "first", "since", "error",
                 "root", "root_ident", "warned")

    def __init__(self, nbytes, dtype):
        self.round = 0
        self.nbytes = nbytes
        self.dtype = dtype
        self.stores = None if nbytes is None else (aligned_empty(nbytes), aligned_empty(nbytes))
        self.reset()

    def reset(self):
        self.senders = []        # ranks that pushed this round, in arrival order
        self.waiters = []        # their ROUTER identities
        self.first = None        # (rank, nbytes, dtype) of the first push, for error messages
        self.since = 0.0
        self.error = None
        self.root = None
        self.root_ident = None
        self.warned = False

    @property
    def store(self):
        return self.stores[self.round & 1]


class Server:
    def __init__(self, cfg, ctx=None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 1000)
        self.data.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.port = self.data.bind_to_random_port(f"tcp://{cfg.node_host}")
        self.control = ControlClient(self.ctx, cfg, {"role": "server", "host": cfg.node_host, "port": self.port})
        self.keys = {}
        self.num_workers = None
        self.index = None
        self.epoch = None
        self.scratch = bytearray()

    # ---------------------------------------------------------------- control plane

    def _on_control(self):
        header, body = self.control.recv()
        if header.cmd == Cmd.ADDRBOOK:
            if body["epoch"] != self.epoch:
                self.keys.clear()  # a new epoch (init after shutdown): workers restart every round at 0
            self.epoch = body["epoch"]
            self.num_workers = body["size"]
            self.index = body["you"]["index"]
            self.control.node_id = body["you"]["node_id"]
            self.ranks = {w["node_id"]: w["rank"] for w in body["workers"]}
            logger.info("server %d serving %d workers (epoch %d)", self.index, self.num_workers, self.epoch)
        elif header.cmd == Cmd.TERMINATE:
            return 0
        elif header.cmd == Cmd.ABORT:
            raise PeerLostError(body.get("reason", "the scheduler aborted the job"))
        elif header.cmd == Cmd.ERROR:
            raise BytePSError(f"the scheduler refused this server: {body.get('error')}")
        return None

    # ---------------------------------------------------------------- data plane

    def _discard_rest(self):
        while self.data.getsockopt(zmq.RCVMORE):
            self.data.recv_into(self.scratch)

    def _send(self, frames, copy=True):
        try:
            self.data.send_multipart(frames, copy=copy)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            # that worker is gone; the scheduler reports the loss to everyone
            logger.debug("reply to a disconnected worker dropped")

    def _reply_error(self, ident, header, msg):
        body = wire.encode({"error": msg})
        self._send([ident, wire.pack(Cmd.ERROR, sender=self.control.node_id, key=header.key, round=header.round,
                                     length=len(body)), body])

    def _on_data(self):
        ident = self.data.recv()
        if not self.data.getsockopt(zmq.RCVMORE):
            return
        raw = self.data.recv()
        try:
            header = wire.unpack(raw)
            if header.cmd not in (Cmd.PUSHPULL, Cmd.BROADCAST):
                raise ProtocolError(f"{Cmd(header.cmd).name} is not a data request")
            if self.num_workers is None:
                raise ProtocolError("data arrived before the address book")
            if not self.data.getsockopt(zmq.RCVMORE):
                raise ProtocolError("data request without a body frame")
        except ProtocolError as e:
            self._discard_rest()
            logger.warning("rejected a malformed data message: %s", e)
            return
        rank = self.ranks.get(header.sender, f"node {header.sender}")
        st = self.keys.get(header.key)
        if st is None:
            # a broadcast's size is known only from the root's message
            size = header.length if header.cmd == Cmd.PUSHPULL else None
            st = self.keys[header.key] = _Round(size, header.dtype)
        if not st.senders:
            st.since = time.monotonic()
        problem = st.error or self._check(st, header, rank)
        if problem is None:
            problem = self._accept(st, header, rank, ident)
        else:
            self._discard_rest()
        if problem is not None and st.error is None:
            st.error = problem
        st.senders.append(rank)
        st.waiters.append(ident)
        if len(st.senders) == self.num_workers:
            self._complete(st, header)

    def _check(self, st, h, rank):
        """Why this message cannot join the round, or None."""
        name = f"key {wire.split_key(h.key)}"
        if h.round != st.round:
            return f"{name}: rank {rank} sent round {h.round} while the server is at round {st.round}"
        if rank in st.senders:
            return f"{name}: rank {rank} sent round {h.round} twice"
        if h.dtype not in dtypes.INFO:
            return f"{name}: rank {rank} sent unknown dtype code {h.dtype}"
        if h.cmd == Cmd.BROADCAST:
            if st.root is not None and h.arg != st.root:
                return (f"{name}: broadcast root differs across workers: rank {st.first[0]} names root {st.root}, "
                        f"rank {rank} names root {h.arg}")
            if h.arg != rank and h.length != 0:
                return f"{name}: non-root rank {rank} sent {h.length} bytes with a broadcast"
            return None
        first = st.first or (f"in round {st.round - 1}, every rank", st.nbytes, st.dtype)
        if (h.length, h.dtype) != (first[1], first[2]):
            return (f"{name}: rank {rank} pushed {h.length} bytes of {dtypes.name(h.dtype)} but rank {first[0]} "
                    f"pushed {first[1]} bytes of {dtypes.name(first[2])}")
        return None

    def _accept(self, st, h, rank, ident):
        """Take the body into the store; return an error message if the body is not what the header said."""
        if st.first is None:
            st.first = (rank, h.length, h.dtype)
        if h.cmd == Cmd.BROADCAST:
            st.root = h.arg
            if h.arg != rank:
                self._discard_rest()
                return None
            st.root_ident = ident
            if st.nbytes != h.length or st.dtype != h.dtype:
                st.nbytes, st.dtype = h.length, h.dtype
                st.stores = (aligned_empty(h.length), aligned_empty(h.length))
            got = self.data.recv_into(st.store)
        elif st.first[0] == rank:
            got = self.data.recv_into(st.store)
        else:
            frame = self.data.recv(copy=False)
            got = len(frame)
            if got == h.length:
                sum_into(st.store, frame.buffer, h.dtype)
        self._discard_rest()
        if got != h.length:
            return f"key {wire.split_key(h.key)}: rank {rank}'s header says {h.length} bytes but {got} arrived"
        return None

    def _complete(self, st, h):
        node = self.control.node_id
        if st.error is None and h.cmd == Cmd.BROADCAST and st.root_ident is None:
            st.error = f"key {wire.split_key(h.key)}: broadcast root rank {st.root} never sent its data"
        if st.error is not None:
            logger.warning("%s", st.error)
            for ident in st.waiters:
                self._reply_error(ident, h, st.error)
        else:
            store = st.store
            for ident in st.waiters:
                # the broadcast root already has the data: it gets an empty reply
                body = b"" if h.cmd == Cmd.BROADCAST and ident == st.root_ident else store
                self._send([ident, wire.pack(Cmd.REPLY, sender=node, key=h.key, round=st.round, length=len(body),
                                             dtype=st.dtype), body], copy=False)
        st.round += 1
        st.reset()

    def _warn_stalls(self):
        now = time.monotonic()
        for key, st in self.keys.items():
            if st.senders and not st.warned and now - st.since > STALL_WARNING_S:
                missing = sorted(set(self.ranks.values()) - set(st.senders))
                logger.warning("key %s round %d has waited %.0f s for ranks %s (have %s)", wire.split_key(key),
                               st.round, now - st.since, missing, st.senders)
                st.warned = True

    # ---------------------------------------------------------------- loop

    def run(self):
        self.control.register()
        poller = zmq.Poller()
        poller.register(self.data, zmq.POLLIN)
        poller.register(self.control.sock, zmq.POLLIN)
        tick_ms = min(self.cfg.heartbeat_interval, 1.0) * 1000
        while True:
            events = dict(poller.poll(timeout=tick_ms))
            if self.control.sock in events:
                code = self._on_control()
                if code is not None:
                    logger.info("job complete; server exiting")
                    return code
            if self.data in events:
                # drain a burst of data messages before looking at the clock again
                for _ in range(64):
                    self._on_data()
                    if not self.data.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
            self.control.tick()
            self._warn_stalls()

    def close(self):
        self.data.close(linger=1000)
        self.control.close()


def main():
    try:
        cfg = bps_config.load(role="server")
    except ConfigError as e:
        print(f"byteps server: {e}", file=sys.stderr)
        return 2
    setup_logging("server")
    server = Server(cfg)
    try:
        return server.run()
    except BytePSError as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        server.close()
