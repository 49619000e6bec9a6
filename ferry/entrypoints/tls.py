"""HTTPS for `ferry serve` and `ferry gateway` (vLLM's --ssl-* flags), and the gateway's HTTPS to
its workers.

An API key sent over plain HTTP is readable by anyone on the path; a cluster without a mesh that
encrypts for it needs the server itself to speak TLS. --ssl-ca-certs with --ssl-cert-reqs 2 asks
every client for a certificate signed by that CA (mutual TLS: only holders of such a certificate
get an HTTP exchange at all); the gateway presents one to its workers with --worker-ssl-certfile.

--enable-ssl-refresh reloads the certificates when their files change (cert-manager and other
rotators rewrite them in place, or swap a Kubernetes secret volume's symlink): new connections get
the new ones, open ones keep theirs. A server's live context is never changed: each change loads
a fresh one, and the live one's SNI callback (which OpenSSL calls at every ClientHello, with or
without a server name) hands each new handshake the newest. Loading into the live context instead
would leave it broken when a file changes between the certificate's read and the key's (OpenSSL
drops the key of a certificate it replaces), and serving an old certificate of another key type
(a context holds one per type). A pair that does not load (a key written before its certificate,
say) is tried again at the next change, the one loaded before serving meanwhile. The gateway's
client context (its HTTP client holds it) is loaded in place, from one private copy of the files
that a scratch context loaded first; its CAs are added to, not replaced, and a client certificate
of another key type joins the old one, which OpenSSL may go on presenting: after such a rotation,
restart the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# How often --enable-ssl-refresh looks at the files (a stat each: cheap; rotations happen days apart).
REFRESH_INTERVAL_S = 1.0


def add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (vLLM's flags)")
    g.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="the server's private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, metavar="PATH",
                   help="the server's certificate chain (PEM): serve HTTPS instead of HTTP")  # fmt: skip
    g.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                   help="CA certificates (PEM) that clients' certificates must be signed by")  # fmt: skip
    g.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=int(ssl.CERT_NONE),
                   help="client certificates: 0 not asked for, 1 checked if sent, 2 required (mutual TLS; "
                        "health probes then need one too)")  # fmt: skip
    g.add_argument(
        "--enable-ssl-refresh",
        action="store_true",
        help="reload the certificate, key and CA files when they change (new connections get them)",
    )


def add_worker_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS to workers (https:// worker URLs)")
    g.add_argument("--worker-ssl-ca-certs", default=None, metavar="PATH",
                   help="CA certificates (PEM) the workers' certificates are checked against (default: the "
                        "system's, or $SSL_CERT_FILE / $SSL_CERT_DIR)")  # fmt: skip
    g.add_argument("--worker-ssl-certfile", default=None, metavar="PATH",
                   help="a client certificate (PEM) to present to workers that require one (their "
                        "--ssl-cert-reqs 2)")  # fmt: skip
    g.add_argument("--worker-ssl-keyfile", default=None, metavar="PATH", help="its private key (PEM)")


@dataclass(frozen=True)
class CertificateFiles:
    """The files behind one SSLContext: its own chain (and key) and the CAs it checks peers with."""

    certfile: str | None
    keyfile: str | None
    ca_certs: str | None

    def paths(self) -> list[str]:
        return [p for p in (self.certfile, self.keyfile, self.ca_certs) if p]

    def load_into(self, ctx: ssl.SSLContext) -> None:
        if self.certfile:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        if self.ca_certs:
            ctx.load_verify_locations(self.ca_certs)


def _loaded(files: CertificateFiles, ctx: ssl.SSLContext, flags: str | None = None) -> ssl.SSLContext:
    """`ctx` with `files` loaded; a ValueError (naming `flags`, if given) when they do not load."""
    where = f"{flags}: " if flags else ""
    try:
        files.load_into(ctx)
    except FileNotFoundError as e:
        raise ValueError(f"{where}no such file: {e.filename}") from None
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"{where}{e}") from None
    return ctx


def server_tls(args: argparse.Namespace) -> CertificateFiles | None:
    """The server's certificate files from the --ssl-* flags, checked by loading them now (a bad file
    or a key that is not the certificate's stops the start with a message, before the model loads);
    None: plain HTTP."""
    if args.ssl_certfile is None:
        given = [f for f, v in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-ca-certs", args.ssl_ca_certs)) if v]
        if given or args.ssl_cert_reqs:
            flag = given[0] if given else "--ssl-cert-reqs"
            raise ValueError(f"{flag} needs --ssl-certfile (the server's certificate)")
        return None
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CAs that clients' certificates are "
                         "checked against)")  # fmt: skip
    files = CertificateFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    _loaded(files, ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), "--ssl-certfile/--ssl-keyfile/--ssl-ca-certs")
    return files


def watchers(
    args: argparse.Namespace,
    server: CertificateFiles | None,
    worker_client: tuple[ssl.SSLContext | bool, CertificateFiles | None] = (True, None),
) -> Watching | None:
    """--enable-ssl-refresh's watchers over the server's files and the gateway's client files, if on."""
    if not args.enable_ssl_refresh:
        return None
    found = [CertificateWatcher(server)] if server else []
    ctx, files = worker_client
    if files is not None and isinstance(ctx, ssl.SSLContext):
        found.append(CertificateWatcher(files, ctx, "to workers"))
    if not found:
        raise ValueError("--enable-ssl-refresh needs certificate files to watch (--ssl-certfile)")
    return Watching(found)


def uvicorn_tls_options(files: CertificateFiles | None, cert_reqs: int) -> dict:
    """uvicorn.Config's keyword arguments for serving `files` (none: plain HTTP)."""
    if files is None:
        return {}
    return {"ssl_certfile": files.certfile, "ssl_keyfile": files.keyfile, "ssl_ca_certs": files.ca_certs,
            "ssl_cert_reqs": cert_reqs}  # fmt: skip


def worker_client_tls(args: argparse.Namespace) -> tuple[ssl.SSLContext, CertificateFiles | None]:
    """What the gateway's HTTP client verifies https:// workers with (httpx's `verify`), and the files
    behind it (None: the system's trust store, nothing to refresh). Always the system's store by
    default (OpenSSL's paths, $SSL_CERT_FILE / $SSL_CERT_DIR), not httpx's own bundle: a CA an
    operator installed in the image counts with or without a client certificate."""
    if args.worker_ssl_keyfile and not args.worker_ssl_certfile:
        raise ValueError("--worker-ssl-keyfile needs --worker-ssl-certfile")
    files = CertificateFiles(args.worker_ssl_certfile, args.worker_ssl_keyfile, args.worker_ssl_ca_certs)
    # Hostnames and chains checked either way; the system's CAs unless others are named.
    ctx = ssl.create_default_context() if files.ca_certs is None else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if not files.paths():
        return ctx, None
    return _loaded(files, ctx, "--worker-ssl-certfile/--worker-ssl-keyfile/--worker-ssl-ca-certs"), files


def _signature(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is rewritten or its symlink swapped (None: missing just now)."""
    try:
        st = os.stat(path)  # follows symlinks: a secret volume's ..data swap changes the inode
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


@contextlib.contextmanager
def _snapshot(files: CertificateFiles) -> Iterator[CertificateFiles]:
    """`files` copied once into a private directory (memory-backed where /dev/shm is): contexts
    loaded from the copy load the same bytes, whatever happens to the files meanwhile."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="ferry-tls-", dir=shm) as d:  # mode 0700

        def copy(path: str | None, name: str) -> str | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                data = f.read()
            out = os.path.join(d, name)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as g:
                g.write(data)
            return out

        yield CertificateFiles(copy(files.certfile, "cert.pem"), copy(files.keyfile, "key.pem"),
                               copy(files.ca_certs, "ca.pem"))  # fmt: skip


class CertificateWatcher:
    """--enable-ssl-refresh over one context's files (see the module's docstring for how)."""

    def __init__(self, files: CertificateFiles, ctx: ssl.SSLContext | None = None, what: str = "server") -> None:
        self.files, self.what = files, what
        self.live: ssl.SSLContext | None = None
        self.make: Callable[[CertificateFiles], ssl.SSLContext] | None = None
        self.current: ssl.SSLContext | None = None  # a server's newest context (None: the live one's own)
        self.seen = self._signatures()
        self.reloads = 0
        if ctx is not None:
            self.attach(ctx)

    def attach(self, live: ssl.SSLContext, make: Callable[[CertificateFiles], ssl.SSLContext] | None = None) -> None:
        """Watch for `live`. A server's: `make(files)` builds a context as the live one was built."""
        self.live = live
        if live.protocol == ssl.PROTOCOL_TLS_SERVER:
            self.make = make or (lambda files: _loaded(files, ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)))
            live.sni_callback = self._select

    def _select(self, ssl_object, server_name, ctx) -> None:
        if self.current is not None:
            ssl_object.context = self.current  # this handshake goes on with the newest certificates

    def _signatures(self) -> list:
        return [_signature(p) for p in self.files.paths()]

    def check(self) -> bool:
        """Reload if the files changed since last seen and now load; whether it reloaded."""
        now = self._signatures()
        if now == self.seen or self.live is None:
            return False
        self.seen = now
        try:
            if self.make is not None:
                self.current = self.make(self.files)
            else:
                with _snapshot(self.files) as copy:  # a scratch context first: a pair that fails leaves all
                    _loaded(copy, ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
                    copy.load_into(self.live)
        except (ValueError, ssl.SSLError, OSError) as e:
            logger.warning("TLS refresh (%s): the changed files do not load (%s); keeping the certificates "
                           "loaded before, trying again at the next change", self.what,
                           e)  # fmt: skip
            return False
        self.reloads += 1
        logger.info("TLS refresh (%s): reloaded %s", self.what, ", ".join(self.files.paths()))
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_INTERVAL_S)
            self.check()


class Watching:
    """The watchers' tasks while a server runs (started on its loop, cancelled at its shutdown)."""

    def __init__(self, watchers: list[CertificateWatcher]) -> None:
        self.watchers = watchers
        self.tasks: list[asyncio.Task] = []

    def start(self, server_ctx: ssl.SSLContext | None,
              make: Callable[[CertificateFiles], ssl.SSLContext] | None = None) -> None:  # fmt: skip
        """`server_ctx`: the context the server made, `make` how it makes one from files."""
        for w in self.watchers:
            if w.live is None and server_ctx is not None:
                w.attach(server_ctx, make)
            self.tasks.append(asyncio.get_running_loop().create_task(w.run()))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.tasks = []
