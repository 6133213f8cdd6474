"""Summation Service server event loop.

Data plane: one ROUTER socket on DMLC_NODE_HOST (random port, announced to the scheduler).
A worker sends ``[header PUSHPULL(key, round), partition bytes]``; the server

* holds the first push of a round as it arrived (ZeroMQ's own message buffer, no copy), makes
  the key's page-aligned store the sum of the first two pushes in one pass (``sum_many``, a
  Cython ``nogil`` kernel), and sums every later push into the store from its message buffer,
* answers all workers of the round with the store, zero-copy, once every worker has pushed.

A worker on the same machine sends a shared-memory descriptor instead of the bytes (FLAG_SHM):
the server sums straight from the worker's region and answers with a descriptor of its store,
which lives in shared memory too (core/shm.py). When a single machine pushes (one worker machine,
its processes reduced locally), the sum is that push: the server answers with the pusher's own
region and copies nothing.

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
from byteps.core import auth, dtypes, shm, wire
from byteps.core._reduce import aligned_empty, copy_into, sum_into, sum_many
from byteps.core.control import ControlClient
from byteps.errors import BytePSError, ConfigError, PeerLostError, ProtocolError
from byteps.log import logger, setup as setup_logging

Cmd = wire.Cmd
#: log a stall warning when a round has waited this long for its last pushes
STALL_WARNING_S = 60.0


class _Round:
    """State of one key: the current round's arrivals and the two stores."""

    __slots__ = ("round", "nbytes", "dtype", "stores", "shared", "senders", "waiters", "first", "since", "error",
                 "root", "root_ident", "warned", "echo", "held", "header")

    def __init__(self, nbytes, dtype, alloc):
        self.round = 0
        self.nbytes = nbytes
        self.dtype = dtype
        self.stores = self.shared = None
        if nbytes is not None:
            self.allocate(nbytes, alloc)
        self.reset()

    def allocate(self, nbytes, alloc):
        """Two stores (alternate rounds), in shared memory when colocated workers may read them."""
        self.nbytes = nbytes
        if alloc is None:
            self.stores = (aligned_empty(nbytes), aligned_empty(nbytes))
            self.shared = None
        else:
            (a, pa), (b, pb) = alloc.alloc(nbytes), alloc.alloc(nbytes)
            self.stores, self.shared = (a, b), (pa, pb)

    def reset(self):
        self.senders = []        # ranks that pushed this round, in arrival order
        self.waiters = []        # their ROUTER identities
        self.first = None        # (rank, nbytes, dtype) of the first push, for error messages
        self.since = 0.0
        self.error = None
        self.root = None
        self.root_ident = None
        self.warned = False
        self.echo = None         # a lone pusher's shared region: the sum is the push itself
        self.held = None         # the round's first push, not yet copied (a shared view or a zmq Frame)
        self.header = None       # the round's last header (to complete it when a rank joins)

    @property
    def store(self):
        return self.stores[self.round & 1]

    def store_descriptor(self):
        return shm.describe(self.shared[self.round & 1], self.nbytes)


class Server:
    def __init__(self, cfg, ctx=None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 1000)
        self.data.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.port = self.data.bind_to_random_port(f"tcp://{cfg.node_host}")
        info = {"role": "server", "host": cfg.node_host, "port": self.port}
        self.alloc = self.probe = None
        if cfg.enable_ipc and shm.supported():
            self.alloc = shm.Allocator("byteps-server")
            self.probe = shm.Probe()
            info["shm"] = self.probe.info()
        self.maps = shm.PeerMaps()
        self.gate = auth.Gate(auth.job_secret())  # workers prove they know the job's secret first
        self.control = ControlClient(self.ctx, cfg, info)
        self.keys = {}
        self.num_workers = None
        self.pushers = None
        self.joined = ()         # ranks in join(): push_pulls complete without them (they add zeros)
        self.active_pushers = None
        self.index = None
        self.epoch = None
        self.scratch = bytearray()

    # ---------------------------------------------------------------- control plane

    def _on_control(self):
        header, body = self.control.recv()
        if header.cmd == Cmd.CHALLENGE:
            self.control.on_challenge(body)
        elif header.cmd == Cmd.ADDRBOOK:
            self.epoch = body["epoch"]
            self.num_workers = body["size"]
            # one push_pull per machine when machines reduce locally first; broadcasts involve every rank
            self.pushers = body.get("pushers", self.num_workers)
            self.index = body["you"]["index"]
            self.control.node_id = body["you"]["node_id"]
            self.ranks = {w["node_id"]: w["rank"] for w in body["workers"]}
            logger.info("server %d serving %d workers (epoch %d)", self.index, self.num_workers, self.epoch)
            # workers get the address book only after every server has answered this
            self.control.send(Cmd.ADDRBOOK, {"epoch": self.epoch})
        elif header.cmd == Cmd.LEAVE:
            # every worker called shutdown(): they may init() again, restarting every key at round 0
            self._reset_keys()
            self.num_workers = None
        elif header.cmd == Cmd.JOIN:
            self._on_join(body)
        elif header.cmd == Cmd.TERMINATE:
            return 0
        elif header.cmd == Cmd.ABORT:
            raise PeerLostError(body.get("reason", "the scheduler aborted the job"))
        elif header.cmd == Cmd.ERROR:
            raise BytePSError(f"the scheduler refused this server: {body.get('error')}")
        return None

    def _reset_keys(self):
        self.keys.clear()
        self.maps.close()
        if self.alloc is not None:
            self.alloc.reset()

    def _on_join(self, body):
        if body["done"]:  # everyone joined: a sync point, every key restarts at round 0
            self.joined = ()
            self._reset_keys()
            return
        self.joined = tuple(body["joined"])
        self.active_pushers = body["pushers"]
        for st in self.keys.values():  # rounds that were waiting only for a rank that just joined
            h = st.header
            if h is not None and h.cmd == Cmd.PUSHPULL and st.senders and len(st.senders) >= self.active_pushers:
                self._complete(st, h)

    def _expected(self, cmd):
        """Messages that complete a round: one push_pull per machine still pushing; every rank for a broadcast."""
        if cmd != Cmd.PUSHPULL:
            return self.num_workers
        return self.active_pushers if self.joined else self.pushers

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
            if header.cmd in (Cmd.HELLO, Cmd.AUTH):
                self._on_handshake(ident, header)
                return
            if not self.gate.allows(ident):
                self._discard_rest()
                if ident not in self.gate.refused:
                    self.gate.refused.add(ident)
                    logger.warning("ignored data from an unauthenticated peer %r (it never proved it knows "
                                   "BYTEPS_JOB_SECRET)", ident)
                return
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
        if self.joined and header.cmd == Cmd.BROADCAST:  # as in Horovod: not while ranks have joined
            self._discard_rest()
            self._reply_error(ident, header, f"broadcast is not supported while ranks {list(self.joined)} have "
                                             "joined (join()); it works again once every rank has joined")
            return
        st = self.keys.get(header.key)
        if st is None:
            # a broadcast's size is known only from the root's message
            size = header.length if header.cmd == Cmd.PUSHPULL else None
            st = self.keys[header.key] = _Round(size, header.dtype, self.alloc)
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
        st.waiters.append((ident, header.flags & wire.FLAG_SHM))
        st.header = header
        if len(st.senders) >= self._expected(header.cmd):
            self._complete(st, header)

    def _on_handshake(self, ident, header):
        try:
            body = wire.decode(self.data.recv()) if self.data.getsockopt(zmq.RCVMORE) else {}
        except ProtocolError:
            body = {}
        self._discard_rest()
        if self.gate.secret is None:
            if header.cmd == Cmd.HELLO:  # say why at once rather than let the worker time out
                self._send([ident] + wire.control(Cmd.ERROR, self.control.node_id, {
                    "error": "this server has no BYTEPS_JOB_SECRET but the worker uses one"}))
            return
        if header.cmd == Cmd.HELLO:
            self._send([ident] + wire.control(Cmd.CHALLENGE, self.control.node_id, self.gate.challenge(ident, body)))
        elif not self.gate.check(ident, body.get("mac")):
            logger.warning("refused worker connection %r: authentication failed", ident)

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
                st.dtype = h.dtype
                st.allocate(h.length, self.alloc)
        if h.flags & wire.FLAG_SHM:
            body = self.data.recv()
            try:
                src = self.maps.view(body)
            except ProtocolError as e:
                self._discard_rest()
                return f"key {wire.split_key(h.key)}: rank {rank}'s shared memory: {e}"
            got = src.size
            if got == h.length and h.cmd == Cmd.PUSHPULL and self.pushers == 1:
                st.echo = body  # one machine: answer with its own region, no copy
            elif got == h.length and h.cmd == Cmd.BROADCAST:
                copy_into(st.store, src)
            elif got == h.length:
                self._add(st, src, src, h.dtype)
        elif h.cmd == Cmd.BROADCAST:
            got = self.data.recv_into(st.store)
        else:
            frame = self.data.recv(copy=False)
            got = len(frame)
            if got == h.length:
                self._add(st, frame, frame.buffer, h.dtype)
        self._discard_rest()
        if got != h.length:
            return f"key {wire.split_key(h.key)}: rank {rank}'s header says {h.length} bytes but {got} arrived"
        return None

    @staticmethod
    def _add(st, keep, data, dtype):
        """Fold one push into the round. The first is only held (its shared region or zmq frame stays
        valid until the round's replies); the second makes store = first + second in one pass
        (sum_many: 3 buffers of traffic instead of a copy then a sum, 5); later ones add in place."""
        if st.senders == [] and st.held is None:
            st.held = (keep, data)
        elif st.held is not None:
            sum_many(st.store, [st.held[1], data], dtype)
            st.held = None
        else:
            sum_into(st.store, data, dtype)

    def _complete(self, st, h):
        node = self.control.node_id
        if st.error is None and h.cmd == Cmd.BROADCAST and st.root_ident is None:
            st.error = f"key {wire.split_key(h.key)}: broadcast root rank {st.root} never sent its data"
        if st.error is None and st.held is not None:  # a lone push: the sum is that push
            copy_into(st.store, st.held[1])
        st.held = None
        if st.error is not None:
            logger.warning("%s", st.error)
            for ident, _ in st.waiters:
                self._reply_error(ident, h, st.error)
        else:
            store = st.store
            for ident, shared in st.waiters:
                flags = 0
                if h.cmd == Cmd.BROADCAST and ident == st.root_ident:
                    body = b""  # the broadcast root already has the data
                elif st.echo is not None:
                    body, flags = st.echo, wire.FLAG_SHM
                elif shared:
                    body, flags = st.store_descriptor(), wire.FLAG_SHM  # the worker copies from our store
                else:
                    body = store
                self._send([ident, wire.pack(Cmd.REPLY, sender=node, key=h.key, round=st.round, length=st.nbytes
                                             if flags else len(body), dtype=st.dtype, flags=flags), body], copy=False)
        st.round += 1
        st.reset()

    def _warn_stalls(self):
        now = time.monotonic()
        for key, st in self.keys.items():
            if st.senders and not st.warned and now - st.since > STALL_WARNING_S:
                logger.warning("key %s round %d has waited %.0f s: pushes from ranks %s are in, %d expected",
                               wire.split_key(key), st.round, now - st.since, st.senders, self.pushers)
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
        self.maps.close()


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
