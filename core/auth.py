"""Per-job authentication: HMAC-SHA256 challenge-response on every connection, in both directions.

With BYTEPS_JOB_SECRET set (bpslaunch --local generates one), every connection starts with

    client -> HELLO     {nonce: n_c}
    server -> CHALLENGE {nonce: n_s, proof: HMAC(secret, "server" | n_c | client identity)}
    client -> AUTH      {mac:   HMAC(secret, "client" | n_s | client identity)}   (or REGISTER / EXIT
                                                                                    carrying "auth")

The secret never crosses the wire; the labels keep the two directions apart, so answering a
stranger's HELLO gives nothing that could be replayed as a client; fresh nonces prevent replay.
A client checks the proof before it sends anything that matters (a worker never pushes gradients
to a server that cannot prove it knows the secret); a server ignores every data or control
message from an identity that has not authenticated, and logs the refusal.
"""
import hashlib
import hmac
import os
import secrets

NONCE_BYTES = 16


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

    def __init__(self, secret):
        self.secret = secret
        self._pending = {}   # identity -> our nonce, while its handshake is open
        self._passed = set()
        self.refused = set()  # identities already logged as refused (log once each)

    def challenge(self, identity, body):
        """The CHALLENGE body answering a HELLO."""
        ours = nonce()
        self._pending[identity] = ours
        return {"nonce": ours, "proof": server_proof(self.secret, str(body.get("nonce", "")), identity)}

    def check(self, identity, mac):
        """True if ``mac`` answers the challenge we gave ``identity``; it then stays admitted."""
        ours = self._pending.pop(identity, None)
        ok = ours is not None and verify(client_mac(self.secret, ours, identity), mac)
        if ok:
            self._passed.add(identity)
        return ok

    def allows(self, identity):
        return self.secret is None or identity in self._passed

    def admitted(self):
        """Identities that passed (handed to the native thread with the socket)."""
        return list(self._passed)


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
