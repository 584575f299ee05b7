"""Who may talk to a server, and how: ZeroMQ CURVE keys, the loopback rule, random identities.

A server (hub, verifier) with CURVE encrypts every connection and accepts only clients whose
public certificate lies in its allow folder; pyzmq's ZAP authenticator checks each one. A
server without CURVE binds only loopback addresses unless told ``--insecure``: anywhere else,
whoever reaches the port could read prompts and send messages. Certificates are pyzmq's own
files (``zmq.auth.create_certificates``): ``NAME.key`` holds the public key and is handed
out, ``NAME.key_secret`` holds both keys and stays with its owner.

Nothing here imports torch, so the command line can register these options cheaply.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("starhub.security")

KEYGEN_HINT = "make a pair with `starhub keys generate DIR NAME`"


class SecurityError(ValueError):
    """Keys that cannot be used, or a bind that the loopback rule refuses: nothing starts."""


# -- certificates ---------------------------------------------------------------------------

def generate_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (owner-only) with pyzmq; never
    overwrite a key, since servers and clients may already trust it."""
    if not name or name.startswith(".") or os.sep in name or "/" in name:
        raise SecurityError(f"key name {name!r}: use a plain file name such as 'hub' or "
                            f"'target0'")
    folder = Path(directory)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    taken = [str(p) for p in (public, secret) if p.exists()]
    if taken:
        raise SecurityError(f"{' and '.join(taken)} already exist; remove them or pick "
                            f"another NAME")
    folder.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        made = zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old)
    os.chmod(made[0], 0o644)
    return Path(made[0]), Path(made[1])


def load_certificate(path: str | Path, what: str, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) keys of a pyzmq certificate; ``secret`` demands the secret half.
    ``what`` names the option the file came from, for the error message."""
    file = Path(path)
    if not file.is_file():
        raise SecurityError(f"{what} {file}: no such file ({KEYGEN_HINT})")
    try:
        public, secret_key = zmq.auth.load_certificate(file)
        _check_key(public)
        if secret_key is not None:
            _check_key(secret_key)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{what} {file}: not a ZeroMQ CURVE certificate ({exc}); "
                            f"{KEYGEN_HINT}") from None
    if secret and secret_key is None:
        raise SecurityError(f"{what} {file}: holds only a public key; pass the secret "
                            f"certificate, NAME.key_secret")
    return public, secret_key


def _check_key(key: bytes) -> None:
    if len(key) != 40 or len(z85.decode(key)) != 32:
        raise ValueError(f"a CURVE key is 40 Z85 characters, got {len(key)}")


def load_allowed(folder: str | Path, what: str = "--curve-allow") -> int:
    """Check an allow folder: every ``*.key`` loads, and there is at least one."""
    root = Path(folder)
    if not root.is_dir():
        raise SecurityError(f"{what} {root}: not a folder; it holds the public certificates "
                            f"(NAME.key) of the clients allowed to connect")
    keys = sorted(root.glob("*.key"))
    for key in keys:
        load_certificate(key, what, secret=False)
    if not keys:
        raise SecurityError(f"{what} {root}: no public certificates (*.key); copy each "
                            f"client's NAME.key here ({KEYGEN_HINT})")
    if any(root.glob("*.key_secret")):
        log.warning("%s %s holds secret certificates; only public ones (NAME.key) belong "
                    "there", what, root)
    return len(keys)


@dataclass(frozen=True)
class ServerCurve:
    """A server's own key pair and the folder of clients it admits."""

    public: bytes
    secret: bytes
    allow: Path

    @classmethod
    def load(cls, secret_file: str | Path, allow_dir: str | Path) -> ServerCurve:
        public, secret = load_certificate(secret_file, "--curve-secret", secret=True)
        load_allowed(allow_dir)
        return cls(public, secret, Path(allow_dir))


@dataclass(frozen=True)
class ClientCurve:
    """A client's own key pair and the public key of the one server it trusts."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, secret_file: str | Path, server_file: str | Path) -> ClientCurve:
        public, secret = load_certificate(secret_file, "--curve-secret", secret=True)
        server, server_secret = load_certificate(server_file, "--curve-server", secret=False)
        if server_secret is not None:
            log.warning("--curve-server %s holds the server's secret key; a client needs "
                        "only its public certificate, NAME.key", server_file)
        return cls(public, secret, server)


@dataclass(frozen=True)
class ServerSecurity:
    """How a server listens: CURVE, or plain, which needs ``insecure`` off loopback."""

    curve: ServerCurve | None = None
    insecure: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSecurity:
        return cls(server_curve(args.curve_secret, args.curve_allow), args.insecure)


def server_curve(secret_file: str | None, allow_dir: str | None) -> ServerCurve | None:
    if not secret_file and not allow_dir:
        return None
    if not (secret_file and allow_dir):
        raise SecurityError("--curve-secret and --curve-allow go together: the server's "
                            "secret certificate and the folder of allowed clients' public "
                            "certificates")
    return ServerCurve.load(secret_file, allow_dir)


def client_curve(secret_file: str | None, server_file: str | None) -> ClientCurve | None:
    if not secret_file and not server_file:
        return None
    if not (secret_file and server_file):
        raise SecurityError("--curve-secret and --curve-server go together: this client's "
                            "secret certificate and the server's public certificate")
    return ClientCurve.load(secret_file, server_file)


# -- the loopback rule ----------------------------------------------------------------------

def is_loopback(address: str) -> bool:
    """Only this machine can reach ``address``: ipc, inproc, or a tcp loopback host."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard, an interface or a host name: assume others can reach it


def check_bind(address: str, security: ServerSecurity) -> None:
    """Refuse a plain server reachable from other machines unless told ``--insecure``."""
    if security.curve is None and not security.insecure and not is_loopback(address):
        raise SecurityError(
            f"refusing to bind {address} without CURVE: anyone who reaches it could read "
            f"prompts and send messages. Give --curve-secret and --curve-allow "
            f"({KEYGEN_HINT}), bind a loopback address, or pass --insecure on a network "
            f"you trust")


# -- sockets --------------------------------------------------------------------------------

class _AllowList:
    """The public keys of an allow folder, as pyzmq's credentials callback; each refused
    key is logged once (the most recent 1024 remembered)."""

    def __init__(self, folder: Path):
        self.keys = set(zmq.auth.load_certificates(folder))
        self.refused: OrderedDict[bytes, None] = OrderedDict()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self.refused:
            self.refused[key] = None
            if len(self.refused) > 1024:
                self.refused.popitem(last=False)
            log.warning("refused a client whose key %s is not in the allow folder",
                        key.decode(errors="replace"))
        return False


class _Zap:
    """ZAP has one endpoint per ZeroMQ context, so servers sharing a context share one
    authenticator; each server socket gets its own domain and allow folder."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[int, tuple[ThreadAuthenticator, set[str]]] = {}

    def attach(self, ctx: zmq.Context, allow: Path) -> tuple[int, str]:
        with self.lock:
            key = ctx.underlying
            if key not in self.running:
                auth = ThreadAuthenticator(ctx, log=logging.getLogger("starhub.zap"))
                auth.start()
                self.running[key] = (auth, set())
            auth, domains = self.running[key]
            domain = f"starhub-{secrets.token_hex(8)}"
            auth.configure_curve_callback(domain, _AllowList(allow))
            domains.add(domain)
            return key, domain

    def detach(self, key: int, domain: str) -> None:
        with self.lock:
            auth, domains = self.running.get(key, (None, set()))
            domains.discard(domain)
            if auth is not None and not domains:
                auth.stop()
                del self.running[key]


_ZAP = _Zap()


def bind_server(sock: zmq.Socket, address: str, security: ServerSecurity) -> Callable[[], None]:
    """Apply the loopback rule, turn CURVE on, bind. Returns what releases the
    authenticator once the socket is closed."""
    try:
        check_bind(address, security)
    except SecurityError:
        sock.close(0)
        raise
    curve = security.curve
    if curve is None:
        if not is_loopback(address):
            log.warning("serving %s without CURVE (--insecure): traffic is neither "
                        "encrypted nor authenticated", address)
        sock.bind(address)
        return lambda: None
    key, domain = _ZAP.attach(sock.context, curve.allow)
    try:
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.curve_secretkey = curve.secret
        sock.curve_publickey = curve.public
        sock.curve_server = True
        sock.bind(address)
    except Exception:
        _ZAP.detach(key, domain)
        raise
    log.info("CURVE on: clients must hold a key from %s", curve.allow)
    return lambda: _ZAP.detach(key, domain)


_default_client: ClientCurve | None = None


def use_client_curve(curve: ClientCurve | None) -> None:
    """The keys every client socket of this process uses unless given others. A target
    opens and reopens its hub connection deep inside decoding, so the command line sets
    its keys once here."""
    global _default_client
    _default_client = curve


def prepare_client(sock: zmq.Socket, prefix: str, curve: ClientCurve | None = None) -> None:
    """Before ``connect``: an unguessable identity (no pid or address that could repeat
    across machines or containers) and, with keys, CURVE."""
    sock.setsockopt(zmq.IDENTITY, f"{prefix}-{secrets.token_hex(16)}".encode())
    curve = curve or _default_client
    if curve is not None:
        sock.curve_secretkey = curve.secret
        sock.curve_publickey = curve.public
        sock.curve_serverkey = curve.server


# -- command-line options -------------------------------------------------------------------

def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security", "CURVE encrypts every connection and admits only "
                             "clients whose public certificate is in --curve-allow. "
                             f"Without it, only loopback addresses are served ({KEYGEN_HINT})")
    g.add_argument("--curve-secret", metavar="FILE", default=None,
                   help="this server's secret certificate (NAME.key_secret)")
    g.add_argument("--curve-allow", metavar="DIR", default=None,
                   help="folder of the allowed clients' public certificates (NAME.key), "
                        "read at start")
    g.add_argument("--insecure", action="store_true",
                   help="serve a non-loopback address without CURVE (logs a warning): "
                        "anyone who reaches it can read prompts and send messages")


def add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security", "for a server that uses CURVE: both files, or "
                             "neither")
    g.add_argument("--curve-secret", metavar="FILE", default=None,
                   help="this client's secret certificate (NAME.key_secret); its NAME.key "
                        "must be in the server's --curve-allow folder")
    g.add_argument("--curve-server", metavar="FILE", default=None,
                   help="the server's public certificate (its NAME.key)")


def client_curve_from_args(args: argparse.Namespace) -> ClientCurve | None:
    return client_curve(args.curve_secret, args.curve_server)
