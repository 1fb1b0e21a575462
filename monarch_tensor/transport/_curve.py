"""CURVE keys of a job: every TCP link is authenticated and encrypted (zmq CURVE).

One key pair per job. Host agents and a controller's TCP listener are CURVE
*servers* holding the job's secret key; everyone who connects is a CURVE
*client* that must present the same job key pair. A ZAP handler in every
process that listens on TCP admits only clients whose public key is a job key
it knows, so knowing the (public) server key is not enough: a client must hold
the job's secret key. A client without CURVE or with another key never gets a
single message through, so nothing it sends is ever unpickled.

Keys live in a 0600 key file (``monarch-tensor keygen PATH``), in a 0600 job
file, or in the environment a scheduler hands to the agents
(``MONARCH_TENSOR_CURVE_PUBLIC`` / ``MONARCH_TENSOR_CURVE_SECRET``, z85 text).

>>> keys = JobKeys.generate()
>>> keys.save("/tmp/job.key")          # written 0600
>>> JobKeys.load("/tmp/job.key") == keys
True
"""

from __future__ import annotations

import json
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import zmq

from ..errors import JobKeyError

ENV_PUBLIC = "MONARCH_TENSOR_CURVE_PUBLIC"
ENV_SECRET = "MONARCH_TENSOR_CURVE_SECRET"
ENV_KEY_FILE = "MONARCH_TENSOR_KEY_FILE"
ZAP_DOMAIN = "monarch-tensor"


class InsecureConnectionWarning(UserWarning):
    """A job's links accept any peer: ``ca="trust_all_connections"`` without a job key."""


@dataclass(frozen=True)
class JobKeys:
    """A job's CURVE key pair, z85 text (40 characters each)."""

    public: str
    secret: str

    def __repr__(self) -> str:  # never print the secret
        return f"JobKeys(public={self.public!r})"

    @staticmethod
    def generate() -> JobKeys:
        """A fresh key pair (needs libzmq built with CURVE, as pyzmq's wheels are)."""
        if not zmq.has("curve"):
            raise JobKeyError("this libzmq has no CURVE support: TCP links cannot be encrypted")
        public, secret = zmq.curve_keypair()
        return JobKeys(public.decode(), secret.decode())

    @staticmethod
    def trust_all() -> JobKeys:
        """The well-known pair of ``ca="trust_all_connections"`` (Monarch's explicit opt-out of authentication):
        every side derives the same keys, so links stay encrypted but anyone can connect. Warns each time."""
        import hashlib
        import warnings

        from zmq.utils import z85

        warnings.warn("ca='trust_all_connections': the job's links accept any peer that connects (no job key); "
                      "make a key with `monarch-tensor keygen` and pass key_file= to authenticate them",
                      InsecureConnectionWarning, stacklevel=3)
        secret = z85.encode(hashlib.sha256(b"monarch-tensor trust_all_connections").digest()).decode()
        return JobKeys(zmq.curve_public(secret.encode()).decode(), secret)

    @staticmethod
    def for_ca(key_file: str | None, ca) -> JobKeys | None:
        """The keys of an agent or a client: ``key_file``, else the environment's, else (only where ``ca`` is
        ``"trust_all_connections"``) the well-known pair; None where there are none."""
        keys = JobKeys.load(key_file) if key_file else JobKeys.from_env()
        if keys is None and ca == "trust_all_connections":
            keys = JobKeys.trust_all()
        return keys

    def to_env(self) -> dict[str, str]:
        return {ENV_PUBLIC: self.public, ENV_SECRET: self.secret}

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> JobKeys | None:
        e: Mapping[str, str] = os.environ if env is None else env
        if e.get(ENV_PUBLIC) and e.get(ENV_SECRET):
            return JobKeys(e[ENV_PUBLIC], e[ENV_SECRET]).checked()
        if e.get(ENV_KEY_FILE):
            return JobKeys.load(e[ENV_KEY_FILE])
        return None

    def checked(self) -> JobKeys:
        for name, k in (("public", self.public), ("secret", self.secret)):
            if not isinstance(k, str) or len(k) != 40:
                raise JobKeyError(f"the job's {name} key must be 40 characters of z85 text, got {len(k)}")
        try:
            derived = zmq.curve_public(self.secret.encode()).decode()
        except Exception as e:
            raise JobKeyError(f"the job's secret key is not valid z85: {e}") from e
        if derived != self.public:
            raise JobKeyError("the job's public key does not belong to its secret key")
        return self

    def save(self, path: str) -> None:
        """Write the pair to ``path``, readable by this user only (0600)."""
        write_private(path, json.dumps({"public": self.public, "secret": self.secret}))

    @staticmethod
    def load(path: str) -> JobKeys:
        """Read a key file (or a job file holding a ``keys`` entry); refuses files others can read."""
        data = read_private(path)
        try:
            d = json.loads(data)
            d = d.get("keys", d)
            return JobKeys(d["public"], d["secret"]).checked()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise JobKeyError(f"{path} holds no job key pair ({e!r}); make one with `monarch-tensor keygen`") from e


def write_private(path: str, text: str) -> None:
    """Create or replace ``path`` with mode 0600 (never readable by others, not even briefly)."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_private(path: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the path of a key or job file must be a str, got {path!r}")
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise JobKeyError(f"no key or job file at {path}") from e
    if not stat.S_ISREG(st.st_mode):  # before the mode: `chmod 600` is no advice for a directory
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise JobKeyError(f"{path} is {what}, not a key or job file")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise JobKeyError(f"{path} is readable by other users (mode {oct(st.st_mode & 0o777)}); "
                          f"run `chmod 600 {path}`")
    with open(path) as f:
        try:
            return f.read()
        except UnicodeDecodeError as e:
            raise JobKeyError(f"{path} is not a key or job file (not UTF-8 text: {e})") from None


# ---- sockets ----------------------------------------------------------------------
_auth_lock = threading.Lock()
_authenticators: dict[int, tuple[Any, _Allowed]] = {}  # id(context) -> (ThreadAuthenticator, allowed keys)


class _Allowed:
    """ZAP credentials provider: admits the public keys of the jobs this process serves."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def serve_curve(ctx: zmq.Context, sock: zmq.Socket, keys: JobKeys) -> None:
    """Make the next ``bind`` of ``sock`` a CURVE server admitting only holders of ``keys``."""
    from zmq.auth.thread import ThreadAuthenticator

    with _auth_lock:
        entry = _authenticators.get(id(ctx))
        if entry is None:
            auth = ThreadAuthenticator(ctx, log=_quiet_logger())
            auth.start()
            allowed = _Allowed()
            auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=allowed)
            entry = _authenticators[id(ctx)] = (auth, allowed)
        entry[1].keys.add(keys.public.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode())
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def stop_serving(ctx: zmq.Context) -> None:
    """Stop the ZAP thread of ``ctx`` (before terminating the context)."""
    with _auth_lock:
        entry = _authenticators.pop(id(ctx), None)
    if entry is not None:
        entry[0].stop()


def connect_curve(sock: zmq.Socket, keys: JobKeys | None = None) -> None:
    """Make the next ``connect`` of ``sock`` a CURVE client with the job's key pair."""
    keys = keys or process_keys()
    if keys is None:
        raise JobKeyError("no job key in this process: a tcp:// peer needs one (set MONARCH_TENSOR_KEY_FILE, "
                          "or attach through a job)")
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())


# Keys by peer address (a controller may talk to several jobs); the environment's key otherwise.
_peer_keys: dict[str, JobKeys] = {}


def remember_peer(addr: str, keys: JobKeys) -> None:
    before = keys_for(addr)
    _peer_keys[addr] = keys
    if before is not None and before != keys:
        # A socket this process keeps to ``addr`` was made for an earlier peer there (another job's host agent,
        # whose port the system handed out again) and holds that job's keys: the new peer's CURVE handshake
        # refuses it, and zmq drops every message on it without a word. The next send makes a fresh one.
        from .mailbox import local_mailboxes

        for mailbox in local_mailboxes():
            mailbox.forget(addr)


def peers() -> dict[str, JobKeys]:
    """The peers whose keys this process was given (``remember_peer``), by address."""
    return dict(_peer_keys)


def keys_for(addr: str) -> JobKeys | None:
    k = _peer_keys.get(addr)
    if k is None and "|" in addr:
        k = _peer_keys.get(addr.split("|", 1)[0])
    return k or process_keys()


_env_keys: list = []


def process_keys() -> JobKeys | None:
    if not _env_keys:
        _env_keys.append(JobKeys.from_env())
    return _env_keys[0]


def _quiet_logger():
    import logging

    lg = logging.getLogger("monarch_tensor.zap")
    lg.setLevel(logging.WARNING)
    return lg
