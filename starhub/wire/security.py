"""Who may talk to a server, and how: ZeroMQ CURVE keys, the local keystore, the loopback
rule, random identities.

A server (hub, verifier) with CURVE encrypts every connection and accepts only clients whose
public certificate lies in its allow folder; pyzmq's ZAP authenticator checks each one.
Given no keys, servers and clients use this user's local keystore (``local_keys``): CURVE
still, so a peer that is not this user gets no further than the handshake. Only
``--insecure`` turns CURVE off. A server without keys of its own (local or none) binds only
loopback addresses unless told ``--insecure``: anywhere else, whoever reaches the port could
read prompts and send messages. Certificates are pyzmq's own files
(``zmq.auth.create_certificates``): ``NAME.key`` holds the public key and is handed out,
``NAME.key_secret`` holds both keys and stays with its owner.

Nothing here imports torch, so the command line can register these options cheaply.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

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
    """A client's own key pair and the public key of each server it trusts: ``server``, the
    key every server holds (one hub, or a pool whose hubs share a key pair), or ``servers``,
    a key per server address (a pool whose hubs each keep their own key pair)."""

    public: bytes
    secret: bytes
    server: bytes | None = None
    servers: dict[str, bytes] = field(default_factory=dict, hash=False)

    @classmethod
    def load(cls, secret_file: str | Path, server_file: str | Path) -> ClientCurve:
        public, secret = load_certificate(secret_file, "--curve-secret", secret=True)
        return cls(public, secret, _server_key(server_file))

    def server_key(self, address: str | None) -> bytes:
        """The public key the server at ``address`` must hold."""
        if address is not None and address in self.servers:
            return self.servers[address]
        if self.server is not None:
            return self.server
        listed = ", ".join(self.servers)
        raise SecurityError(f"--curve-server lists a public certificate for each of {listed}, "
                            f"not for {address or 'an unnamed address'}: connect to one of "
                            f"those, or list a certificate for it in the same order as the "
                            f"addresses")


def _server_key(server_file: str | Path) -> bytes:
    server, server_secret = load_certificate(server_file, "--curve-server", secret=False)
    if server_secret is not None:
        log.warning("--curve-server %s holds the server's secret key; a client needs "
                    "only its public certificate, NAME.key", server_file)
    return server


def server_files(server_file: str) -> list[str]:
    """The certificates a ``--curve-server`` value lists: one, or several comma-separated."""
    return [f.strip() for f in server_file.split(",") if f.strip()]


@dataclass(frozen=True)
class ServerSecurity:
    """How a server listens: with keys of its own (``curve``), plain (``insecure``), or,
    given neither, with this user's local keys (``local_keys``), on loopback only."""

    curve: ServerCurve | None = None
    insecure: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSecurity:
        return cls(server_curve(args.curve_secret, args.curve_allow), args.insecure)

    @property
    def local(self) -> bool:
        """No keys given and CURVE wanted: the local keystore's keys."""
        return self.curve is None and not self.insecure

    def keys(self) -> ServerCurve | None:
        """The keys to bind with: the given ones, the local keystore's, or none (insecure)."""
        return local_keys().server if self.local else self.curve


@dataclass(frozen=True)
class ClientSecurity:
    """How a client connects: with keys of its own (``curve``), plain (``insecure``: the
    server runs ``--insecure``), or, given neither, with this user's local keys."""

    curve: ClientCurve | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.curve is not None and self.insecure:
            raise SecurityError("--insecure connects without CURVE: give it, or "
                                "--curve-secret and --curve-server, not both")

    @classmethod
    def from_args(cls, args: argparse.Namespace,
                  addresses: Sequence[str] = ()) -> ClientSecurity:
        """``addresses``: the servers this client connects to, in the order of the command
        line (a pool's hubs), which a ``--curve-server`` listing one key per server follows."""
        return cls(client_curve(args.curve_secret, args.curve_server, addresses),
                   args.insecure)

    @property
    def local(self) -> bool:
        """No keys given and CURVE wanted: the local keystore's keys."""
        return self.curve is None and not self.insecure

    def keys(self) -> ClientCurve | None:
        """The keys to connect with: the given ones, the local keystore's, or none."""
        return local_keys().client if self.local else self.curve

    def describe(self) -> str:
        if self.insecure:
            return "without CURVE (--insecure)"
        if self.curve is not None:
            return "with the keys given (--curve-secret, --curve-server)"
        return f"with this user's local keys ({keystore_dir()})"


def server_curve(secret_file: str | None, allow_dir: str | None) -> ServerCurve | None:
    if not secret_file and not allow_dir:
        return None
    if not (secret_file and allow_dir):
        raise SecurityError("--curve-secret and --curve-allow go together: the server's "
                            "secret certificate and the folder of allowed clients' public "
                            "certificates")
    return ServerCurve.load(secret_file, allow_dir)


def client_curve(secret_file: str | None, server_file: str | None,
                 addresses: Sequence[str] = ()) -> ClientCurve | None:
    """This client's keys: ``server_file`` names one public certificate that every server
    holds, or one per address of ``addresses``, comma-separated, in the same order."""
    if not secret_file and not server_file:
        return None
    if not (secret_file and server_file):
        raise SecurityError("--curve-secret and --curve-server go together: this client's "
                            "secret certificate and the server's public certificate")
    files = server_files(server_file)
    if len(files) == 1:
        return ClientCurve.load(secret_file, files[0])
    addresses = list(addresses)
    if len(files) != len(addresses):
        where = f"{len(addresses)} server addresses ({', '.join(addresses)})" if addresses \
            else "no server address"
        raise SecurityError(f"--curve-server lists {len(files)} public certificates for "
                            f"{where}: give one certificate that every server holds, or one "
                            f"per address, in the same order as the addresses")
    public, secret = load_certificate(secret_file, "--curve-secret", secret=True)
    return ClientCurve(public, secret,
                       servers={a: _server_key(f) for a, f in zip(addresses, files, strict=True)})


# -- the local keystore ---------------------------------------------------------------------

KEYSTORE_ENV = "STARHUB_KEYS"


def keystore_dir() -> Path:
    """Where this user's local keys live: ``$STARHUB_KEYS``, else ``$XDG_RUNTIME_DIR/starhub``
    where that runtime folder exists, else ``~/.cache/starhub/keys``."""
    chosen = os.environ.get(KEYSTORE_ENV)
    if chosen:
        return Path(chosen).expanduser().absolute()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "starhub"
    return Path.home() / ".cache" / "starhub" / "keys"


@dataclass(frozen=True)
class LocalKeys:
    """A keystore (a folder only its owner may enter): a server pair whose allow folder holds
    the public key of one client pair. Every process of its user on this host shares it, so
    a server and a client started with no keys find each other, and nobody else."""

    folder: Path
    server: ServerCurve
    client: ClientCurve


_local: dict[Path, LocalKeys] = {}
_local_lock = threading.Lock()


def local_keys() -> LocalKeys:
    """This user's keystore (``keystore_dir``), made on first use and read once per process."""
    folder = keystore_dir()
    with _local_lock:
        if folder not in _local:
            _local[folder] = _open_keystore(folder)
        return _local[folder]


def _open_keystore(folder: Path) -> LocalKeys:
    if not os.path.lexists(folder):
        _make_keystore(folder)
    _check_private(folder)
    if not any(folder.iterdir()):  # an empty folder made for it ($STARHUB_KEYS)
        _make_keystore(folder)
    try:
        server = ServerCurve.load(folder / "server.key_secret", folder / "allow")
        client = ClientCurve.load(folder / "client.key_secret", folder / "server.key")
    except SecurityError as exc:
        raise SecurityError(f"the local keystore {folder}: {exc}. Remove the folder and a "
                            f"new one is made (or set ${KEYSTORE_ENV} to another)") from None
    return LocalKeys(folder, server, client)


def _make_keystore(folder: Path) -> None:
    """Build the keystore in a private folder beside it, then rename that into place: a
    process starting at the same moment sees all of it or nothing, and the one whose
    rename loses uses the winner's keys."""
    try:
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    except OSError as exc:
        raise SecurityError(f"cannot make the local keystore {folder}: {exc}; set "
                            f"${KEYSTORE_ENV} to a folder of your own") from None
    try:
        generate_keys(build, "server")
        public, _ = generate_keys(build, "client")
        (build / "allow").mkdir(mode=0o700)
        shutil.copy(public, build / "allow" / public.name)
        try:
            os.rename(build, folder)
            log.info("made this user's local keys in %s", folder)
        except OSError as exc:
            if not (folder / "server.key_secret").exists():  # not a race lost: a failure
                raise SecurityError(f"cannot make the local keystore {folder}: {exc}; set "
                                    f"${KEYSTORE_ENV} to a folder of your own") from None
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _check_private(folder: Path) -> None:
    """Only its owner, this user, may enter a keystore: anyone who reads it could connect."""
    try:
        st = folder.stat()
    except OSError as exc:
        raise SecurityError(f"the local keystore {folder}: {exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SecurityError(f"the local keystore {folder} is not a folder; remove it or set "
                            f"${KEYSTORE_ENV} to another")
    if st.st_uid != os.getuid():
        raise SecurityError(f"refusing the local keystore {folder}: it belongs to uid "
                            f"{st.st_uid}, not to this user (uid {os.getuid()}); set "
                            f"${KEYSTORE_ENV} to a folder of your own")
    if st.st_mode & 0o077:
        raise SecurityError(f"refusing the local keystore {folder}: others may enter it (mode "
                            f"{stat.S_IMODE(st.st_mode):o}); `chmod 700 {folder}` if nobody "
                            f"else has read it, else remove it and a new one is made")


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
    """Refuse a server reachable from other machines without keys of its own, unless told
    ``--insecure`` (the local keys serve this host only); open the local keystore a server
    without keys uses, so that a problem with it shows before anything loads."""
    if security.curve is None and not security.insecure and not is_loopback(address):
        raise SecurityError(
            f"refusing to bind {address} without CURVE keys of its own (this user's local "
            f"keys serve loopback only): anyone who reaches it could read prompts and send "
            f"messages. Give --curve-secret and --curve-allow ({KEYGEN_HINT}), bind a "
            f"loopback address, or pass --insecure on a network you trust")
    security.keys()


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


class _Authenticator(ThreadAuthenticator):
    """pyzmq's, except that a key many connections share by design (the local client key:
    every process of this user) names no principal, so that each of those connections keeps
    budgets of its own, as without CURVE (``starhub.server.loop.principal_of``)."""

    def __init__(self, ctx: zmq.Context):
        super().__init__(ctx, log=logging.getLogger("starhub.zap"))
        self.shared: set[bytes] = set()

    def curve_user_id(self, client_public_key: bytes) -> str:
        if client_public_key in self.shared:
            return ""
        return super().curve_user_id(client_public_key)


ZAP_REBIND_S = 2.0
"""How long a new authenticator waits for the ZAP endpoint of a stopped one to be freed."""


def _start_authenticator(ctx: zmq.Context) -> _Authenticator:
    """Start an authenticator on ``ctx``. libzmq frees a closed socket's inproc endpoint on
    its reaper thread, so right after the last server of a context stopped its
    authenticator, the ZAP endpoint can still be taken for a moment: try again briefly."""
    deadline = time.monotonic() + ZAP_REBIND_S
    while True:
        auth = _Authenticator(ctx)
        try:
            auth.start()
            return auth
        except zmq.ZMQError as exc:
            auth.stop()
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class _Zap:
    """ZAP has one endpoint per ZeroMQ context, so servers sharing a context share one
    authenticator; each server socket gets its own domain and allow folder."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[int, tuple[_Authenticator, set[str]]] = {}

    def attach(self, ctx: zmq.Context, allow: Path, shared: bytes | None) -> tuple[int, str]:
        with self.lock:
            key = ctx.underlying
            if key not in self.running:
                self.running[key] = (_start_authenticator(ctx), set())
            auth, domains = self.running[key]
            if shared is not None:
                auth.shared.add(z85.decode(shared))
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
    """Apply the loopback rule, turn CURVE on (with the given or the local keys), bind.
    Returns what releases the authenticator once the socket is closed."""
    try:
        check_bind(address, security)
    except SecurityError:
        sock.close(0)
        raise
    curve = security.keys()
    if curve is None:
        if is_loopback(address):
            log.info("serving %s without CURVE (--insecure): any process on this host may "
                     "connect", address)
        else:
            log.warning("serving %s without CURVE (--insecure): traffic is neither "
                        "encrypted nor authenticated", address)
        sock.bind(address)
        return lambda: None
    shared = local_keys().client.public if security.local else None
    key, domain = _ZAP.attach(sock.context, curve.allow, shared)
    try:
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.curve_secretkey = curve.secret
        sock.curve_publickey = curve.public
        sock.curve_server = True
        sock.bind(address)
    except Exception:
        _ZAP.detach(key, domain)
        raise
    if security.local:
        log.info("CURVE on with this user's local keys (%s): only this user's processes on "
                 "this host may connect", local_keys().folder)
    else:
        log.info("CURVE on: clients must hold a key from %s", curve.allow)
    return lambda: _ZAP.detach(key, domain)


_default_client = ClientSecurity()


def use_client_security(security: ClientSecurity | None) -> None:
    """How every client socket of this process connects unless told otherwise (None: the
    default, this user's local keys). A target opens and reopens its hub connection deep
    inside decoding, so the command line sets this once here."""
    global _default_client
    _default_client = security or ClientSecurity()


def prepare_client(sock: zmq.Socket, prefix: str, security: ClientSecurity | None = None,
                   address: str | None = None) -> ClientSecurity:
    """Before ``connect``: an unguessable identity (no pid or address that could repeat
    across machines or containers) and CURVE keys, unless insecure, with the public key of
    the server at ``address`` (``ClientCurve.server_key``). ``security``: None for this
    process's default (``use_client_security``). Returns the security it applied."""
    sock.setsockopt(zmq.IDENTITY, f"{prefix}-{secrets.token_hex(16)}".encode())
    security = _default_client if security is None else security
    curve = security.keys()
    if curve is not None:
        sock.curve_secretkey = curve.secret
        sock.curve_publickey = curve.public
        sock.curve_serverkey = curve.server_key(address)
    return security


# -- handshakes -----------------------------------------------------------------------------

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Handshakes:
    """A client socket's handshakes, watched with a pyzmq socket monitor, so that a server
    that refuses this client is reported with the likely cause rather than merely going
    quiet. Create it before ``connect``; ``failure()`` polls without blocking."""

    def __init__(self, sock: zmq.Socket, security: ClientSecurity, address: str | None = None):
        self.sock, self.security, self.address = sock, security, address
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED
                                               | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.latest: str | None = None

    def failure(self) -> str | None:
        """Why the latest handshake failed; None once one succeeded, or before any ended."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.latest
            except zmq.ZMQError:  # closed meanwhile
                return self.latest
            event = parse_monitor_message(frames)
            self.latest = (None if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
                           else self.cause(event["event"], event["value"]))

    def cause(self, event: int, value: int) -> str:
        how = f"this client connects {self.security.describe()}"
        if self.security.insecure:  # without CURVE only a mechanism mismatch fails
            return (f"it uses CURVE and {how}: drop --insecure to use this user's local "
                    f"keys, or give --curve-secret and --curve-server")
        if (event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
            return f"it does not use CURVE (it runs --insecure?) and {how}: pass --insecure"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"it refused this client's key, which is not in its --curve-allow folder "
                    f"({how})")
        if self.security.local:
            return (f"the CURVE handshake failed and {how}: the server runs without CURVE "
                    f"(--insecure: pass it too) or holds other keys (another user's server, "
                    f"or one started with --curve-secret: give --curve-secret and "
                    f"--curve-server)")
        curve = self.security.curve
        which = "--curve-server is" if curve is None or not curve.servers else \
            (f"the certificate --curve-server lists for {self.address} (one per server, in "
             f"the order of the addresses: is that order the same?) is")
        return (f"the CURVE handshake failed and {how}: the server runs without CURVE "
                f"(--insecure), or {which} not its public key")

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:  # the socket is closed already
            pass
        self.monitor.close(0)


