"""The shared secret of the services and the handshake that proves it on every connection.

Where the secret comes from, first to last (`load_secret`, the only lookup):
    1. an explicit argument (`RpcServer(..., secret=...)`, `RpcClient.connect(..., secret=...)`);
    2. `SPECSERVE_SECRET_FILE`: a file holding it (surrounding whitespace is ignored);
    3. `SPECSERVE_SECRET`: the value itself.
No secret at all is a `SettingsError` (the `specserve` CLI prints it as one line, exit status 2).
`specserve up` and `specserve.shared.host.launch.ServiceProcess` make one up (`ensure_secret`) when none is set
and hand it to their children through the environment, never on a command line.

The handshake, as typed messages (shared/wire/messages.py) on a fresh connection, mutual:

    client -> AuthHello(client nonce)
    server -> AuthChallenge(server nonce, HMAC(secret, "specserve-auth-v1 server" | cn | sn))
              the client checks the server's proof before it proves anything itself
    client -> AuthProof(HMAC(secret, "specserve-auth-v1 client" | cn | sn))
    server -> AuthOk, or Error("unauthenticated") and the connection is closed

HMAC is HMAC-SHA256, nonces are 32 random bytes each, proofs are compared with
`hmac.compare_digest`. The two labels differ, so a proof can never be reflected back as the other
side's; the server's nonce is fresh per challenge and used once, so a proof cannot be replayed.
Until the handshake is done a connection gets answers to `Health` only (rpc.py enforces that).
Frames are authenticated at connect time only, not encrypted: see docs/deployment.md, "Running the
services across hosts".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from collections.abc import MutableMapping

from specserve.shared.process.settings import SettingsError
from specserve.shared.wire.messages import AuthChallenge, AuthHello, AuthOk, AuthProof, Error, Message

SECRET_FILE_VAR = "SPECSERVE_SECRET_FILE"
SECRET_VAR = "SPECSERVE_SECRET"
MIN_SECRET_CHARS = 16
NONCE_BYTES = 32
MAX_FAILURES = 3  # calls refused before authenticating, then the connection is closed
_LABEL = b"specserve-auth-v1 "


class AuthError(ConnectionError):
    """This end could not authenticate the connection (a wrong secret on one side, or a peer that
    does not speak the handshake). A transport error: the connection is closed."""


def load_secret(explicit: str | bytes | None = None,
                environ: MutableMapping[str, str] | None = None) -> bytes:
    """The shared secret: `explicit`, else the file named by SPECSERVE_SECRET_FILE, else
    SPECSERVE_SECRET. Raises SettingsError (one line naming the variable) if there is none or it
    is too short."""
    env = os.environ if environ is None else environ
    if explicit is not None:
        where, text = "the secret given", explicit.decode() if isinstance(explicit, bytes) else explicit
    elif env.get(SECRET_FILE_VAR):
        where = f"{SECRET_FILE_VAR}={env[SECRET_FILE_VAR]}"
        try:
            with open(env[SECRET_FILE_VAR], encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise SettingsError(f"{where}: cannot read the secret file ({exc.strerror})") from None
    elif env.get(SECRET_VAR):
        where, text = SECRET_VAR, env[SECRET_VAR]
    else:
        raise SettingsError(f"no shared secret: set {SECRET_FILE_VAR} (a file holding it) or {SECRET_VAR} "
                            "(`specserve up` makes one for its own services)")
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise SettingsError(f"{where}: the secret must have at least {MIN_SECRET_CHARS} characters")
    return text.encode()


_ENSURE_LOCK = threading.Lock()


def ensure_secret(environ: MutableMapping[str, str] | None = None) -> bytes:
    """The shared secret; when none is set, a new random one is put into SPECSERVE_SECRET of
    `environ` (default os.environ) first, so that children started afterwards inherit it."""
    env = os.environ if environ is None else environ
    with _ENSURE_LOCK:  # services started side by side from threads must not each make their own
        if not env.get(SECRET_FILE_VAR) and not env.get(SECRET_VAR):
            env[SECRET_VAR] = secrets.token_hex(32)
    return load_secret(environ=env)


def _proof(secret: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, _LABEL + role + client_nonce + server_nonce, hashlib.sha256).digest()


class ClientHandshake:
    """The client's side: `hello()`, then `prove(challenge)` (which first checks the server's proof)."""

    def __init__(self, secret: bytes):
        self._secret = secret
        self._nonce = secrets.token_bytes(NONCE_BYTES)

    def hello(self) -> AuthHello:
        return AuthHello(self._nonce)

    def prove(self, challenge: AuthChallenge) -> AuthProof:
        """Raises AuthError if the server did not prove that it holds the secret."""
        if len(challenge.nonce) != NONCE_BYTES:
            raise AuthError(f"the server's nonce has {len(challenge.nonce)} bytes, not {NONCE_BYTES}")
        expected = _proof(self._secret, b"server", self._nonce, challenge.nonce)
        if not hmac.compare_digest(challenge.proof, expected):
            raise AuthError("the service does not hold our shared secret (SPECSERVE_SECRET / SPECSERVE_SECRET_FILE "
                            "differ between the two ends)")
        return AuthProof(_proof(self._secret, b"client", self._nonce, challenge.nonce))


class ServerHandshake:
    """The server's side, one per connection: `answer(message)` for every message other than Health
    until `authenticated`; `refused` means: send the answer, then close the connection."""

    def __init__(self, secret: bytes):
        self._secret = secret
        self._client_nonce: bytes | None = None
        self._server_nonce: bytes | None = None
        self.failures = 0
        self.authenticated = False
        self.refused = False

    def answer(self, body: Message) -> Message:
        if self.authenticated:
            return Error("bad_message", f"{type(body).__name__}: this connection is already authenticated")
        if isinstance(body, AuthHello):
            if len(body.nonce) != NONCE_BYTES:
                return self._refuse(f"the client's nonce has {len(body.nonce)} bytes, not {NONCE_BYTES}")
            self._client_nonce, self._server_nonce = body.nonce, secrets.token_bytes(NONCE_BYTES)
            return AuthChallenge(self._server_nonce,
                                 _proof(self._secret, b"server", self._client_nonce, self._server_nonce))
        if isinstance(body, AuthProof):
            if self._client_nonce is None or self._server_nonce is None:
                return self._refuse("AuthProof before AuthHello")
            expected = _proof(self._secret, b"client", self._client_nonce, self._server_nonce)
            self._client_nonce = self._server_nonce = None  # one answer per challenge
            if not hmac.compare_digest(body.proof, expected):
                return self._refuse("wrong proof of the shared secret")
            self.authenticated = True
            return AuthOk()
        self.failures += 1
        if self.failures >= MAX_FAILURES:
            self.refused = True
        return Error("unauthenticated", f"{type(body).__name__} needs an authenticated connection "
                                        "(AuthHello first; see specserve.shared.wire.auth)")

    def _refuse(self, why: str) -> Error:
        self.refused = True
        return Error("unauthenticated", why)
