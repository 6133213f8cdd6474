"""Per-job authentication: HMAC-SHA256 challenge-response on every connection, in both directions.

With BYTEPS_JOB_SECRET set (bpslaunch --local generates one), every connection starts with

    client -> HELLO     {nonce: n_c}
    server -> CHALLENGE {nonce: n_s, proof: HMAC(secret, "server" | n_c | client identity)}
    client -> AUTH      {mac:   HMAC(secret, "client" | n_s | client identity)}   (or REGISTER / EXIT
                                                                                    carrying "auth")

The secret never crosses the wire, the labels keep the two directions apart and fresh nonces prevent
replay; what a stranger can make a gate keep is bounded (PENDING_TTL_S, PENDING_LIMIT).
docs/architecture.md, "Authentication", has the rest.
"""
import collections
import hashlib
import hmac
import os
import secrets
import time

from byteps.log import Throttled

NONCE_BYTES = 16
#: an open handshake (our CHALLENGE sent, the peer's AUTH not yet in) is forgotten after this long
PENDING_TTL_S = 60.0
#: handshakes open at once; beyond it the oldest is forgotten (its AUTH then fails, as a late one does)
PENDING_LIMIT = 4096


def job_secret(env=None):
    """The job's secret as bytes, or None when authentication is off (BYTEPS_JOB_SECRET unset)."""
    raw = (os.environ if env is None else env).get("BYTEPS_JOB_SECRET", "").strip()
    return raw.encode() if raw else None


def nonce():
    return secrets.token_hex(NONCE_BYTES)


def new_identity():
    """A random ZeroMQ identity for a client socket, so both ends know it before the first message."""
    return b"c" + secrets.token_bytes(15)


def _mac(secret, label, nonce_hex, identity):
    return hmac.new(secret, label + b"|" + nonce_hex.encode() + b"|" + identity, hashlib.sha256).hexdigest()


def server_proof(secret, client_nonce, identity):
    return _mac(secret, b"server", client_nonce, identity)


def client_mac(secret, server_nonce, identity):
    return _mac(secret, b"client", server_nonce, identity)


def verify(expected, given):
    return isinstance(given, str) and hmac.compare_digest(expected, given)


class AuthError(Exception):
    """Raised when a peer cannot prove it knows the job's secret (wrapped by the callers)."""


class Gate:
    """The accepting side of a socket: answers HELLOs, checks MACs, remembers who passed."""

    def __init__(self, secret, clock=time.monotonic):
        self.secret = secret
        self._clock = clock
        self._pending = collections.OrderedDict()  # identity -> (our nonce, when), oldest first
        self._passed = set()
        self.refusals = Throttled()  # warnings about strangers: a flood costs a counter, not a line each

    def challenge(self, identity, body):
        """The CHALLENGE body answering a HELLO."""
        now = self._clock()
        while self._pending and (len(self._pending) >= PENDING_LIMIT or
                                 now - next(iter(self._pending.values()))[1] > PENDING_TTL_S):
            self._pending.popitem(last=False)
        ours = nonce()
        self._pending.pop(identity, None)  # a HELLO again: the newest challenge counts, from now
        self._pending[identity] = (ours, now)
        return {"nonce": ours, "proof": server_proof(self.secret, str(body.get("nonce", "")), identity)}

    def check(self, identity, mac):
        """True if ``mac`` answers the challenge we gave ``identity`` (within PENDING_TTL_S); it then
        stays admitted."""
        entry = self._pending.pop(identity, None)
        ours = entry[0] if entry is not None and self._clock() - entry[1] <= PENDING_TTL_S else None
        ok = ours is not None and verify(client_mac(self.secret, ours, identity), mac)
        if ok:
            self._passed.add(identity)
        return ok

    def allows(self, identity):
        return self.secret is None or identity in self._passed

    def admitted(self):
        """Identities that passed (handed to the native thread with the socket)."""
        return list(self._passed)

    def open_handshakes(self):
        """Handshakes open now (tests check the bound)."""
        return len(self._pending)


class Knock:
    """The connecting side: the HELLO to send, and the check of the answer."""

    def __init__(self, secret, identity):
        self.secret = secret
        self.identity = identity
        self.nonce = nonce()

    def hello(self):
        return {"nonce": self.nonce}

    def answer(self, body, who):
        """The MAC to send back; AuthError if ``who`` could not prove it knows the secret."""
        if not verify(server_proof(self.secret, self.nonce, self.identity), body.get("proof")):
            raise AuthError(f"{who} could not prove it knows BYTEPS_JOB_SECRET: refusing to talk to it")
        return client_mac(self.secret, str(body.get("nonce", "")), self.identity)
