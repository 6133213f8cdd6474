"""The engine's start-up (core/engine.py): from registration to the hand-over of the data sockets.

In order (_setup): register and wait for the address book; connect to every server and to this
machine's other processes; authenticate both ways (core/auth.py); agree on the partition size and
credit (byteps/autotune.py); open direct links; then hand the sockets and links to the native core,
which owns them from then on. Later local handshakes and link offers still come here (_on_local).
"""
import dataclasses
import os
import socket
import threading
import time

import zmq

from byteps import autotune, config, timeline
from byteps.errors import BytePSError, BytePSTimeoutError, PeerLostError, ProtocolError
from byteps.log import logger
from byteps.placement import Placement

from . import auth, device_buffer, shm, stages, transport, wire
from .control import ControlClient
from .local import LocalPlan, machine_plan
from .stages import Stage

from . import _worker_core


Cmd = wire.Cmd


class EngineSetup:
    """Start-up of :class:`~byteps.core.engine.Engine` (a mixin: its methods run on the engine thread)."""

    def _start_native(self):
        """Open a direct link to every server and local peer and hand them to the native thread
        (core/pipeline/bps_worker.h): partitions never go through ZeroMQ."""
        if not _worker_core.available:
            raise BytePSError(f"the native worker core cannot run here: {_worker_core.unavailable_reason}")
        from ._reduce import get_num_threads

        core = _worker_core.WorkerCore(self.control.node_id, self.cfg.scheduling_credit * self.cfg.partition_bytes,
                                       self.cfg.timeout, get_num_threads(), self._wake_w)
        core.set_direct_spin(self.cfg.spin_us * 1e-6)
        for sock in self.servers:
            self.poller.unregister(sock)  # their data comes on the links, and their control before this
            core.add_server()
        self._open_links(core)
        # the local reduce too (its owners by BYTEPS_LOCAL_STRATEGY: core/local.py)
        if self.local is not None:
            links = self._open_local_links()
            self.poller.unregister(self._local_sock)
            core.add_local(self._local_sock, self.cfg.local_rank, self.local.size)
            core.set_lone_machine(self.cfg.num_worker == 1)  # the same rule as stages.stage_list(machines=)
            for lr, (fd, ident, ring_fd, low) in links.items():
                why = core.add_local_link(lr, fd, ident, -1 if ring_fd is None else ring_fd, low)
                if ring_fd is not None:
                    os.close(ring_fd)  # the native mapping keeps the memory
                if why:
                    raise BytePSError(f"local rank {lr}: the shared-memory rings of its link could not be mapped: "
                                      f"{why}")
            self._native_local = True
            logger.info("native local reduce: %d processes on this machine, sums >= %d bytes on thread "
                        "byteps-reduce, %d of %d local peers over direct links (%d through shared-memory "
                        "rings)", self.local.size, _worker_core.STAGE_THREAD_MIN_BYTES, core.local_links_up,
                        len(self._local_peers), core.local_stats()["rings_up"])
        if timeline.recorder is not None:
            timeline.recorder.add_native(_worker_core.trace_buffer())
        core.set_elastic(self.cfg.elastic)
        for i, shared in enumerate(self.colocated):
            core.set_colocated(i, shared)
        core.start()
        self._native = core
        self._completer = threading.Thread(target=self._deliver_native, name="byteps-complete", daemon=True)
        self._completer.start()
        logger.info("native data plane: partitions to %d servers on thread byteps-net, over direct links",
                    core.links_up)

    def _dealer(self, endpoint):
        """A DEALER connected to ``endpoint``, with an unguessable identity (core/auth.py)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, auth.new_identity())
        sock.connect(endpoint)
        return sock

    def _open_server_link(self, who, host, answer, ident):
        """A direct TCP link to a server, from its LINK answer: the fd."""
        try:
            return transport.open_link(host, int(answer["port"]), bytes.fromhex(answer["token"]), ident,
                                       self.control.node_id, min(self.cfg.timeout, 10.0))
        except (OSError, ValueError, KeyError, TypeError, ProtocolError) as e:  # TypeError: no TCP port
            raise BytePSError(f"no direct link to {who}: {e} (partitions travel over direct links only: "
                              f"is its port reachable from {self.cfg.node_host}?)") from None

    def _answer_challenge(self, sock, knock, header, body, who):
        """Send our AUTH for the CHALLENGE that answered our HELLO, once its sender proved it knows the secret."""
        if header.cmd != Cmd.CHALLENGE:
            raise BytePSError(f"{who} answered {Cmd(header.cmd).name} to our HELLO: "
                              f"{body.get('error', 'does it use the same BYTEPS_JOB_SECRET?')}")
        try:
            mac = knock.answer(body, who)
        except auth.AuthError as e:
            raise PeerLostError(str(e)) from None
        sock.send_multipart(wire.control(Cmd.AUTH, self.control.node_id, {"mac": mac}))

    def _open_links(self, core):
        """Direct links to the servers (core/transport/bps_link.h, bps_ucx.h): ask each for a one-time
        token over the authenticated ZeroMQ socket, connect, present it, and hand the link to the native
        thread. A server without one fails init() with the reason (one lost meanwhile is skipped)."""
        from . import ucx
        use_ucx = ucx.choose(self.cfg.transport, _worker_core) == "ucx"
        poller, asked = zmq.Poller(), {}
        poller.register(self.control.sock, zmq.POLLIN)  # a server lost meanwhile is not waited for
        for i, sock in enumerate(self.servers):
            if i in self._lost_at_start:
                continue
            sock.send_multipart(wire.control(Cmd.LINK, self.control.node_id))
            poller.register(sock, zmq.POLLIN)
            asked[sock] = i
        answers, limit = {}, min(self.cfg.timeout, 10.0)
        deadline = time.monotonic() + limit
        while asked and time.monotonic() < deadline:
            self.control.tick()  # the scheduler must not take our wait for a server's answer for our loss
            for sock, _ in poller.poll(timeout=100):
                if sock is self.control.sock:
                    self._drain(sock, lambda _: self._on_control())
                    asked = {s: i for s, i in asked.items() if i not in self._lost_at_start}
                    continue
                frames = sock.recv_multipart()
                try:
                    header = wire.unpack(frames[0])
                    if header.cmd == Cmd.LINK:
                        answers[asked.pop(sock)] = wire.decode(frames[1]) if len(frames) > 1 else {}
                except ProtocolError as e:
                    logger.warning("malformed answer while opening direct links: %s", e)
                # anything else here is a late PROBE echo (a timed-out probe): dropped
        for i in sorted(asked.values()):
            self._unlinked(i, BytePSTimeoutError(f"no direct link: server {i} ({self.book['servers'][i]['host']}) "
                                                 f"did not answer LINK within {limit:g} s"))
        for i, answer in sorted(answers.items()):
            info = self.book["servers"][i]
            try:
                if "error" in answer:
                    raise BytePSError(f"server {i} ({info['host']}): {answer['error']}")
                ident = self.servers[i].getsockopt(zmq.IDENTITY)
                if use_ucx and "ucx_port" in answer:
                    self._open_ucx_link(core, i, info["host"], answer, ident)
                    continue
                if use_ucx:
                    logger.warning("server %d has no UCX listener (its BYTEPS_TRANSPORT is not ucx): its link is TCP",
                                   i)
                core.add_link(i, self._open_server_link(f"server {i} ({info['host']}:{answer.get('port')})",
                                                        info["host"], answer, ident))
            except BytePSError as e:
                self._unlinked(i, e)

    def _unlinked(self, i, error):
        """Server ``i`` gives no direct link (``error``): init() fails, but with elastic servers a server
        lost meanwhile (killed as the job starts) is reported to the scheduler, which removes it, and
        init() waits for the membership without it, as for one the scheduler reported lost."""
        if not self.cfg.elastic:
            raise error
        logger.warning("%s: reporting server %d to the scheduler as lost (elastic servers)", error, i)
        self.control.send(Cmd.SUSPECT, {"server": i})
        self._lost_at_start.add(i)

    def _open_local_links(self):
        """Direct links to this machine's other worker processes, after the local handshake: {local rank:
        (socket fd, its DEALER identity toward our ROUTER, ring fd or None, whether we are the lower rank)}.

        The higher rank of each pair listens on 127.0.0.1 and offers the lower one a one-time token
        (LINK {port, token, ring}) over its authenticated DEALER; the lower one connects and presents it
        (transport.open_link), with arg 1 if it mapped the offered shared-memory rings
        (core/transport/bps_link.h BpsShmLink). Everyone offers, then connects upward, then accepts from
        below, so no wait is circular. A pair whose link does not come up fails init() with the reason."""
        me, node = self.cfg.local_rank, self.control.node_id
        lower = sorted(lr for lr in self._local_peers if lr < me)
        higher = sorted(lr for lr in self._local_peers if lr > me)
        limit = min(self.cfg.timeout, 10.0)
        links, expected, listener, rings = {}, {}, None, {}
        if lower:
            fd, port = transport.listen_link("127.0.0.1")
            listener = socket.socket(fileno=fd)
            for lr in lower:
                token = os.urandom(transport.TOKEN_BYTES)
                expected[token] = lr
                offer = {"port": port, "token": token.hex(), "local_rank": me}
                try:
                    rings[lr], offer["ring"] = shm.ring_region(_worker_core.RING_REGION_BYTES)
                except OSError as e:
                    logger.info("no shared-memory ring for local rank %d (%s): its link stays on TCP", lr, e)
                self._local_peers[lr].send_multipart(wire.control(Cmd.LINK, node, offer))
        poller = zmq.Poller()
        poller.register(self._local_sock, zmq.POLLIN)
        if listener is not None:
            poller.register(listener.fileno(), zmq.POLLIN)

        def serve_until(done):  # our ROUTER (offers, late knocks) and, below us, connections
            deadline = time.monotonic() + limit
            while not done() and time.monotonic() < deadline:
                for sock, _ in poller.poll(timeout=100):
                    if sock is self._local_sock:
                        self._drain_data(sock, self._on_local)
                    elif listener is not None and sock == listener.fileno():
                        self._accept_local_link(listener, expected, links, limit, rings)
                self.control.tick()

        for lr in higher:
            serve_until(lambda: lr in self._link_offers)
            offer = self._link_offers.pop(lr, None)
            if offer is None:
                raise BytePSTimeoutError(f"local rank {lr} offered no direct link within {limit:g} s")
            port, token, ident, ring_info = offer
            ring_fd = None
            if ring_info is not None:
                try:
                    ring_fd = shm.open_ring(ring_info, _worker_core.RING_REGION_BYTES)
                except ProtocolError as e:
                    logger.info("local rank %d: %s; its link stays on TCP", lr, e)
            try:
                fd = transport.open_link("127.0.0.1", port, token, self._local_peers[lr].getsockopt(zmq.IDENTITY),
                                         node, limit, arg=int(ring_fd is not None))
            except (OSError, ProtocolError) as e:
                if ring_fd is not None:
                    os.close(ring_fd)
                raise BytePSError(f"no direct link to local rank {lr} (127.0.0.1:{port}): {e}") from None
            links[lr] = (fd, ident, ring_fd, True)
        serve_until(lambda: all(lr in links for lr in lower))
        missing = [lr for lr in lower if lr not in links]
        if missing:
            raise BytePSTimeoutError(f"local ranks {missing} did not open their direct links within {limit:g} s")
        for ring_fd in rings.values():  # offered, not taken
            os.close(ring_fd)
        if listener is not None:
            listener.close()
        return links

    def _accept_local_link(self, listener, expected, links, limit, rings):
        """A connection on our local link listener: admitted if it presents a token we offered; its
        hello's arg 1 says it mapped the ring we offered (``rings``: local rank -> our ring fd)."""
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        try:
            conn.settimeout(limit)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            frames = transport.link_recv(conn)
            header = wire.unpack(frames[0])
            body = frames[1] if len(frames) > 1 else b""
            lr = expected.pop(body[:transport.TOKEN_BYTES], None) if header.cmd == Cmd.LINK else None
            ident = body[transport.TOKEN_BYTES:]
            if lr is not None and not self._gate.allows(ident):  # its AUTH may still wait on our ROUTER
                self._drain_data(self._local_sock, self._on_local)
            accepted = lr is not None and self._gate.allows(ident)
            conn.sendall(transport.link_pack([wire.pack(Cmd.LINK, sender=self.control.node_id, arg=int(accepted))]))
            if not accepted:
                logger.warning("refused a local direct link: its token does not match one we offered")
                return
            conn.setblocking(False)
            ring_fd = rings.pop(lr, None) if header.arg == 1 else None
            links[lr] = (conn.detach(), ident, ring_fd, False)
        except (OSError, ProtocolError) as e:
            logger.warning("a local direct link failed its handshake: %s", e)
        finally:
            conn.close()  # after detach() this closes nothing

    def _open_ucx_link(self, core, i, host, answer, ident):
        """A UCX endpoint to server ``i`` (core/transport/bps_ucx.h), admitted by the token of its LINK answer."""
        why = core.add_ucx_link(i, host, int(answer["ucx_port"]), bytes.fromhex(answer["token"]), ident,
                                min(self.cfg.timeout, 10.0))
        if why:
            raise BytePSError(f"no UCX link to server {i} ({host}:{answer['ucx_port']}): {why}")
        logger.info("server %d: UCX link (%s)", i, core.link_transport(i))

    def _setup(self):
        info = {"role": "worker", "host": self.cfg.node_host, "worker_id": self.cfg.worker_id,
                "local_rank": self.cfg.local_rank, "local_size": self.cfg.local_size,
                "local_reduce": self.cfg.local_reduce and self.cfg.local_size > 1 and not self.cfg.enable_async
                and Stage.LOCAL_REDUCE not in self._dropped}
        if info["local_reduce"]:
            self._local_sock = self.ctx.socket(zmq.ROUTER)
            self._local_sock.setsockopt(zmq.LINGER, 0)
            info["local_port"] = self._local_sock.bind_to_random_port("tcp://127.0.0.1")
        if self.cfg.timeline:
            timeline.start(self.cfg).wake = self._wake
        self.control = ControlClient(self.ctx, self.cfg, info)
        self.poller = zmq.Poller()
        self.poller.register(self.control.sock, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.control.register()
        self._serve_control_until(lambda: self.book is not None, self.cfg.timeout,
                                  f"the scheduler at {self.cfg.scheduler_endpoint} did not start the job within "
                                  f"{self.cfg.timeout:g} s (BYTEPS_TIMEOUT); its log names the nodes that never "
                                  "registered")
        self._place_on_cpus()
        for info in self.book["servers"]:
            sock = self._dealer(f"tcp://{info['host']}:{info['port']}")
            self.poller.register(sock, zmq.POLLIN)
            self.servers.append(sock)
        self._server_index = {sock: i for i, sock in enumerate(self.servers)}
        # which server sums which bytes: the k/n split of byteps/placement.py, the same on every worker
        self.placement = Placement.from_book(self.book, self.cfg.placement, self.cfg.partition_bytes, self.rank)
        logger.info("%s", self.placement.describe())
        if self.cfg.enable_ipc:
            # same host address too: network namespaces share a kernel (the probe passes) but are
            # separate hosts, whose traffic must cross their network (bench/netns.py)
            self.colocated = [shm.can_share(info.get("shm"), self._maps) and info["host"] == self.cfg.node_host
                              for info in self.book["servers"]]
        else:
            self.colocated = [False] * len(self.servers)
        if any(self.colocated):
            logger.info("shared memory with servers %s", [i for i, c in enumerate(self.colocated) if c])
        if self.book.get("local_reduce") and self._local_sock is not None:  # a 1-process machine pushes itself
            self._setup_local()
        self._knock_all()
        if Stage.STAGE in self._dropped:  # BYTEPS_PIPELINE=-stage: colocated servers over TCP too
            self.colocated = [False] * len(self.servers)
        self._tune()  # before anything is cut into partitions or sent
        # every server membership of the job so far, in order (elastic servers, docs/elastic.md); the
        # first one's placement is the one _tune() rebuilt with the job's partition size
        self._memberships = [{"members": 0, "placement": self.placement, "cuts": {},
                              "ids": [info["index"] for info in self.book["servers"]]}]
        self._change = None  # (PREPARE body, when it came) while the scheduler changes the servers
        if any(self.colocated) or self.local is not None:
            self._shm = shm.Allocator("byteps-worker")
        self._start_native()
        if self.cfg.elastic:  # the scheduler changes servers only once every worker can hold and commit
            self.control.send(Cmd.MEMBERS, {"phase": "ready"})
            if self._lost_at_start:
                self._await_membership_without(self._lost_at_start)
        self.nccl_stages = self._nccl_stages()
        self._ready.set()

    def _await_membership_without(self, lost):
        """Servers were lost during start-up: the scheduler removes them as soon as every worker is ready
        (scheduler/elastic.py). Wait for that membership, so that no op is cut for a server that has gone."""
        self._serve_control_until(lambda: not any(i in self._memberships[-1]["ids"] for i in lost), self.cfg.timeout,
                                  f"init() waited {self.cfg.timeout:g} s (BYTEPS_TIMEOUT) for the scheduler at "
                                  f"{self.cfg.scheduler_endpoint} to remove servers {sorted(lost)}, lost during "
                                  "start-up; its log says which worker did not answer the change")

    def _serve_control_until(self, done, limit, late):
        """Take the scheduler's messages (and this machine's processes' knocks) and send our heartbeats until
        ``done()``; BytePSTimeoutError(``late``) after ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while not done():
            if self._stopped.is_set():
                raise BytePSError("init() was interrupted")
            if time.monotonic() > deadline:
                raise BytePSTimeoutError(late)
            for sock, _ in self.poller.poll(timeout=100):
                if sock is self.control.sock:
                    self._drain(sock, lambda _: self._on_control())
                elif sock is self._local_sock:
                    self._drain_data(sock, self._on_local)
                elif sock == self._wake_r:
                    self._read_wake()
                elif sock in self._server_index:  # a late PROBE echo (a timed-out probe): drop it
                    self._drain_data(sock, lambda s, frames: None)
            self.control.tick()

    def _tune(self):
        """Partition size (job-wide) and credit (this worker's) from the link (byteps/autotune.py): probe
        one server (with local reduce, local rank 0 only: its machine shares one NIC), then agree through
        the scheduler, which hands every worker's proposal to all, so the partition sizes cannot differ."""
        started = time.monotonic()
        env = os.environ
        weights, me = self.placement.weights, self.cfg.node_host
        shape = autotune.job_shape(self.book["servers"], weights, me,
                                   self.placement.min_cut if self.cfg.placement == "balanced" else 0)
        both_set = all((env.get(v) or "").strip() for v in ("BYTEPS_PARTITION_BYTES", "BYTEPS_SCHEDULING_CREDIT"))
        measurement = None
        if not both_set and (self.local is None or self.cfg.local_rank == 0):
            alive = [0 if i in self._lost_at_start else w for i, w in enumerate(weights)]
            measurement = autotune.test_link(env) or self._probe(
                autotune.probe_target(self.book["servers"], alive, me, self.rank))
        # a machine that reduces locally has its own per-piece cost in the model (byteps/autotune.py)
        mine = autotune.propose(measurement, shape, self.cfg.placement,
                                autotune.PIECE_COST_NATIVE if self.local is None else autotune.PIECE_COST_LOCAL_REDUCE,
                                self.cfg.worker_id, env)
        self.control.send(Cmd.BARRIER, {"name": autotune.AGREE_BARRIER, "value": mine})
        # the scheduler answers, naming the ranks it lacks, after BYTEPS_TIMEOUT; this wait is longer
        limit = self.cfg.timeout + 5
        self._serve_control_until(lambda: self._agreed is not None, limit,
                                  f"init() waited {limit:g} s for the scheduler at {self.cfg.scheduler_endpoint} to "
                                  "hand out the job's partition size (it needs every worker's link probe; its log "
                                  "names the ranks it lacks)")
        if "error" in self._agreed:
            raise BytePSTimeoutError(f"the job's partition size was not agreed: {self._agreed['error']}")
        self._tune_shape = shape
        tuning = autotune.agree(self._agreed["values"], self.rank, shape, env)
        self.tuning = tuning = tuning._replace(took_s=time.monotonic() - started)
        self.cfg = dataclasses.replace(self.cfg, partition_bytes=tuning.partition_bytes,
                                       scheduling_credit=tuning.credit)
        # nothing is cut yet: the placement with the agreed partition size
        self.placement = Placement.from_book(self.book, self.cfg.placement, tuning.partition_bytes, self.rank)
        logger.info("%s; %.0f ms", tuning.text, tuning.took_s * 1e3)

    def expect_model(self, model_bytes):
        """An optimizer pushes ``model_bytes`` of gradients per step (any thread; every rank calls it at the
        same point): choose the partition size again from the proposals every worker holds, so that every
        rank cuts alike, for tensors first used from now on. Nothing changes where BYTEPS_PARTITION_BYTES
        is set or nothing was measured."""
        if self.tuning is None or self.tuning.source != "probe" or self._agreed is None:
            return
        tuning = autotune.agree(self._agreed["values"], self.rank, self._tune_shape, model_bytes=model_bytes)
        if tuning.partition_bytes == (self.partition_bytes or self.cfg.partition_bytes):
            return
        self.tuning = tuning._replace(took_s=self.tuning.took_s)
        self.partition_bytes = tuning.partition_bytes  # read by submit() on the callers' threads
        if self._native is not None:
            self._native.set_credit(tuning.credit * tuning.partition_bytes)
        logger.info("%s; tensors first used from now on", tuning.text)

    def _probe(self, server):
        """Time PROBE echoes to one server (autotune.probe); None, with a warning, if it fails."""
        if server is None:
            return None
        who = f"server {server} ({self.book['servers'][server]['host']}:{self.book['servers'][server]['port']})"
        try:
            echo = autotune.zmq_echo(self.servers[server], self.control.node_id, min(5.0, self.cfg.timeout),
                                     idle=self.control.tick)
            return autotune.probe(echo, autotune.PROBE_SIZES, autotune.PROBE_REPEATS, autotune.PROBE_BUDGET_S)
        except (BytePSError, ValueError) as e:
            logger.warning("could not probe the link to %s (%s); proposing no partition size", who, e)
            return None

    def _knock_all(self):
        """Authenticate to every server and local peer (core/auth.py) before sending them anything.

        Our own local ROUTER is served meanwhile: the machine's other processes knock on it too.
        """
        secret = auth.job_secret()
        self._gate = auth.Gate(secret)
        if secret is None:
            return
        waiting = {}
        for i, sock in enumerate(self.servers):
            waiting[sock] = (auth.Knock(secret, sock.getsockopt(zmq.IDENTITY)), f"server {i}")
        for lr, sock in self._local_peers.items():
            waiting[sock] = (auth.Knock(secret, sock.getsockopt(zmq.IDENTITY)), f"local rank {lr}")
        for sock, (knock, _) in waiting.items():
            sock.send_multipart(wire.control(Cmd.HELLO, self.control.node_id, knock.hello()))
        for sock in self._local_peers.values():  # only the CHALLENGE ever comes back on these
            self.poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + self.cfg.timeout
        while True:
            for sock in [s for s in waiting if self._server_index.get(s) in self._lost_at_start]:
                del waiting[sock]  # the scheduler removed that server (elastic): its answer will not come
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise BytePSTimeoutError("no authentication answer within BYTEPS_TIMEOUT from "
                                         + ", ".join(who for _, who in waiting.values()))
            for sock, _ in self.poller.poll(timeout=100):
                if sock is self._local_sock:
                    self._drain_data(sock, self._on_local)
                elif sock is self.control.sock:
                    self._on_control()
                elif sock in waiting:
                    header, body = wire.unpack(sock.recv()), {}
                    if sock.getsockopt(zmq.RCVMORE):
                        body = wire.decode(sock.recv())
                    self._discard(sock)
                    knock, who = waiting.pop(sock)
                    self._answer_challenge(sock, knock, header, body, who)
                elif self._server_index.get(sock) in self._lost_at_start:  # removed, yet it had sent something:
                    sock.recv()  # dropped, or it would stay readable and this wait would spin
                    self._discard(sock)
            self.control.tick()
        for sock in self._local_peers.values():
            self.poller.unregister(sock)

    def _place_on_cpus(self):
        """Where this process stands among the job's worker processes on this host: start() binds the
        training thread to a CPU where they fill its CPUs, and callers poll longer where they outnumber
        them (byteps/cpus.py, BYTEPS_CPU_BIND, BYTEPS_SPIN_US=auto). Counted per host address, not per
        machine of the job: bpslaunch --local runs several "machines" on one host."""
        here = sorted((w["worker_id"], w["local_rank"]) for w in self.book["workers"]
                      if w["host"] == self.cfg.node_host)
        me = (self.cfg.worker_id, self.cfg.local_rank)
        if me not in here:  # registered under another address: count ourselves alone
            here = [me]
        self._cpu_slot = (here.index(me), len(here))
        if self.cfg.spin_auto:
            self.cfg = dataclasses.replace(self.cfg, spin_us=config.auto_spin_us(len(here)))

    def _setup_local(self):
        """Connect to this machine's other worker processes for the local reduce."""
        peers = [w for w in self.book["workers"] if w["worker_id"] == self.cfg.worker_id]
        plan = None
        if self.cfg.local_strategy == "topology":
            plan = machine_plan(len(peers))
            logger.info("local reduce by the topology plan: %s, groups %s%s", plan.strategy,
                        [list(g) for g in plan.groups], f", roots {list(plan.roots)}" if plan.roots else "")
        self.local = LocalPlan(peers, self.cfg.local_push, plan)
        for w in self.local.peers:
            if w["local_rank"] == self.cfg.local_rank:
                continue
            sock = self._dealer(f"tcp://127.0.0.1:{w['local_port']}")
            self._local_peers[w["local_rank"]] = sock
        self.poller.register(self._local_sock, zmq.POLLIN)
        logger.info("local reduce with %d processes on this machine", self.local.size)

    def _nccl_stages(self):
        """Whether this process's CUDA push_pulls take the NCCL stages (core/pipeline/nccl_stages.h): with
        BYTEPS_LOCAL_STRATEGY=topology, on a machine whose plan has a GPU per process, where NCCL is found.
        The same on every process of a machine (its plan, environment and libraries), as it must be."""
        cfg = self.cfg
        if cfg.local_strategy != "topology":
            return False
        if self.local is None:
            if cfg.local_size > 1:
                logger.warning("BYTEPS_LOCAL_STRATEGY=topology has no effect: this job does not reduce locally "
                               "(BYTEPS_LOCAL_REDUCE=0, BYTEPS_PIPELINE=-local_reduce, asynchronous training, or a "
                               "machine that does not)")
            return False
        plan = self.local.topology
        why = None
        if plan is None or plan.device != "gpu":
            why = "this machine's topology plan has no GPU per process"
        elif cfg.elastic:
            why = "BYTEPS_ELASTIC=1"
        elif device_buffer.library_path("nccl", cfg.nccl) is None:
            why = "NCCL is not found (BYTEPS_NCCL, or a CUDA build of PyTorch that ships it)"
        if why is not None:
            logger.info("CUDA push_pulls take the copy stages and the host's local reduce, not the NCCL stages: %s",
                        why)
            return False
        logger.info("pipeline of a CUDA push_pull partition: %s (its root), %s (the other local ranks)",
                    stages.describe(stages.nccl_stage_list(True, machines=cfg.num_worker)),
                    stages.describe(stages.nccl_stage_list(False, machines=cfg.num_worker)))
        return True

    def _on_local(self, sock, frames):
        """Our local ROUTER's control messages: handshakes and link offers of this machine's other
        processes (its data, LOCAL_READY / LOCAL_DONE, is the native core's)."""
        if len(frames) != 3:
            logger.warning("dropped a local message with %d frames", len(frames))
            return
        try:
            header = wire.unpack(frames[1])
        except ProtocolError as e:
            self._gate.refusals.warning("dropped a malformed local message: %s", e)
            return
        peer = frames[0]
        if header.cmd in (Cmd.HELLO, Cmd.AUTH):
            self._local_handshake(sock, peer, header, frames[2])
            return
        if not self._gate.allows(peer):
            self._gate.refusals.warning("ignored a local message from an unauthenticated peer %r", peer)
            return
        if header.cmd == Cmd.LINK:  # a higher local rank offers a direct link (_open_local_links)
            try:
                offer = wire.decode(frames[2])
                self._link_offers[int(offer["local_rank"])] = (int(offer["port"]), bytes.fromhex(offer["token"]), peer,
                                                               offer.get("ring"))
            except (ProtocolError, KeyError, TypeError, ValueError) as e:
                logger.warning("dropped a malformed local link offer: %s", e)

    def _local_handshake(self, sock, peer, header, raw):
        if self._gate.secret is None:
            return
        try:
            body = wire.decode(raw)
        except ProtocolError:
            body = {}
        if header.cmd == Cmd.HELLO:
            reply = wire.control(Cmd.CHALLENGE, self.control.node_id, self._gate.challenge(peer, body))
            if self._native_local:  # the native thread owns our ROUTER now
                self._native.answer_local(peer, reply[0], reply[1])
            else:
                sock.send_multipart([peer] + reply)
        elif not self._gate.check(peer, body.get("mac")):
            self._gate.refusals.warning("refused local peer %r: authentication failed", peer)
