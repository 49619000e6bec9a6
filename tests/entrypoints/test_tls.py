"""HTTPS: `ferry serve` with mutual TLS and certificate refresh, `ferry gateway` over HTTPS to an
HTTPS worker, the flags' checks, and the refresh that keeps a pair that loads (entrypoints/tls.py).

Certificates are made by openssl here: a CA, a server certificate for 127.0.0.1 and a client
certificate signed by it, and a client certificate from another CA."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading

import httpx
import pytest

from ferry.entrypoints.tls import CertificateWatcher, add_tls_args, server_tls
from tests.server_utils import GatewayProcess, ServerProcess, wait_for

MODEL = "smol"
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d, name: str) -> tuple[str, str]:
    key, pem = str(d / f"{name}.key"), str(d / f"{name}.pem")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key,
            "-out", pem, "-days", "2", "-subj", f"/CN={name}")  # fmt: skip
    return pem, key


def make_cert(d, name: str, ca: tuple[str, str], usage: str, key_type: str = "ec") -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by `ca` (its serial is random: each call's differs), with
    an EC P-256 key or (`key_type` "rsa") an RSA one."""
    key, csr, pem, ext = (str(d / f"{name}.{x}") for x in ("key", "csr", "pem", "ext"))
    with open(ext, "w") as f:
        f.write(f"subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n"
                "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")  # fmt: skip
    new_key = (
        ["-newkey", "rsa:2048"] if key_type == "rsa" else ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    )
    openssl("req", *new_key, "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    serial = str(int.from_bytes(os.urandom(8)))
    openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-set_serial", serial, "-out", pem, "-days", "2",
            "-extfile", ext)  # fmt: skip
    return pem, key


def serial_of(pem: str) -> int:
    out = subprocess.run(
        ["openssl", "x509", "-in", pem, "-noout", "-serial"], check=True, capture_output=True, text=True
    )
    return int(out.stdout.strip().split("=")[1], 16)


def client_context(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(*cert)
    return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, rogue_ca = make_ca(d, "ca"), make_ca(d, "rogue-ca")
    return {
        "dir": d,
        "ca": ca,
        "server": make_cert(d, "server", ca, "serverAuth"),
        "client": make_cert(d, "client", ca, "clientAuth"),
        "rogue": make_cert(d, "rogue", rogue_ca, "clientAuth"),
    }


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> tuple[int, int | None]:
    """A TLS handshake over a socket pair: (the serial of the certificate the server presented, that
    of the client's, None when it sent none). The client's error, if it fails."""
    a, b = socket.socketpair()
    seen: dict[str, int] = {}

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True) as tls:
                cert = tls.getpeercert()
                if cert:
                    seen["client"] = int(cert["serialNumber"], 16)
        except (ssl.SSLError, OSError):
            pass  # the client says why

    served = threading.Thread(target=serve)
    served.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname="127.0.0.1") as tls:
            server_serial = int(tls.getpeercert()["serialNumber"], 16)
    finally:
        served.join(10)
        b.close()
        a.close()
    return server_serial, seen.get("client")


def peer_serial(server_ctx: ssl.SSLContext, ca: str, client: ssl.SSLContext | None = None) -> int:
    """The serial of the certificate `server_ctx` presents to `client` (else a default client trusting `ca`)."""
    return handshake(server_ctx, client or client_context(ca))[0]


def install(src: str, dst: str) -> None:
    """`src`'s bytes at `dst`, swapped in whole (a rename), as certificate rotators write them."""
    shutil.copyfile(src, dst + ".tmp")
    os.replace(dst + ".tmp", dst)


def tls_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tls_args(p)
    return p.parse_args(flags)


def test_flags_are_checked_before_anything_starts(pki):
    cert, key = pki["server"]
    for flags, message in [
        (("--ssl-keyfile", key), "--ssl-keyfile needs --ssl-certfile"),
        (("--ssl-cert-reqs", "2"), "--ssl-cert-reqs needs --ssl-certfile"),
        (("--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"), "needs --ssl-ca-certs"),
        (("--ssl-certfile", cert, "--ssl-keyfile", pki["client"][1]), "--ssl-certfile/--ssl-keyfile"),  # not its key
        (("--ssl-certfile", cert, "--ssl-keyfile", str(pki["dir"] / "missing.key")), "no such file"),
    ]:
        with pytest.raises(ValueError, match=message):
            server_tls(tls_args(*flags))
    assert server_tls(tls_args()) is None
    files = server_tls(tls_args("--ssl-certfile", cert, "--ssl-keyfile", key))
    assert (files.certfile, files.keyfile, files.ca_certs) == (cert, key, None)


def test_serve_refuses_bad_tls_flags_before_loading_the_model(pki):
    # The mismatched pair stops `ferry serve` with exit 2 and the flags named (no engine core spawned).
    cert, _ = pki["server"]
    r = subprocess.run([sys.executable, "-m", "ferry.cli", "serve", "--port", "0", "--ssl-certfile", cert,
                        "--ssl-keyfile", pki["client"][1]], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--ssl-certfile/--ssl-keyfile" in r.stderr


@pytest.mark.parametrize("first", ["certificate", "key"])
def test_refresh_keeps_the_loaded_pair_until_the_new_one_loads(pki, tmp_path, first):
    """A rotation that writes one file, then the other: the half-written pair is refused (the context
    keeps the old pair, handshakes go on; loaded into it, a certificate first would cost it its key),
    the completed pair is taken."""
    old = make_cert(tmp_path, "old", pki["ca"], "serverAuth")
    new = make_cert(tmp_path, "new", pki["ca"], "serverAuth")
    live = (str(tmp_path / "live.pem"), str(tmp_path / "live.key"))
    for src, dst in zip(old, live):
        install(src, dst)
    files = server_tls(tls_args("--ssl-certfile", live[0], "--ssl-keyfile", live[1]))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    files.load_into(ctx)
    watcher = CertificateWatcher(files, ctx)
    assert not watcher.check()  # nothing changed
    assert peer_serial(ctx, pki["ca"][0]) == serial_of(old[0])

    order = [0, 1] if first == "certificate" else [1, 0]
    install(new[order[0]], live[order[0]])
    assert not watcher.check()
    assert peer_serial(ctx, pki["ca"][0]) == serial_of(old[0])

    install(new[order[1]], live[order[1]])
    assert watcher.check() and watcher.reloads == 1
    assert peer_serial(ctx, pki["ca"][0]) == serial_of(new[0])


def test_a_rotation_to_another_key_type_serves_no_old_certificate(pki, tmp_path):
    """EC to RSA: a context holds a certificate per key type, so one loaded in place would still
    answer clients that take only ECDSA with the old (maybe revoked) certificate. The refresh
    hands handshakes a fresh context: such a client now fails instead."""
    old = make_cert(tmp_path, "old", pki["ca"], "serverAuth")
    new = make_cert(tmp_path, "new", pki["ca"], "serverAuth", key_type="rsa")
    live = (str(tmp_path / "live.pem"), str(tmp_path / "live.key"))
    for src, dst in zip(old, live):
        shutil.copyfile(src, dst)
    files = server_tls(tls_args("--ssl-certfile", live[0], "--ssl-keyfile", live[1]))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    files.load_into(ctx)
    watcher = CertificateWatcher(files, ctx)
    ecdsa_only = client_context(pki["ca"][0])
    ecdsa_only.maximum_version = ssl.TLSVersion.TLSv1_2
    ecdsa_only.set_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256")
    assert peer_serial(ctx, pki["ca"][0], ecdsa_only) == serial_of(old[0])
    for src, dst in zip(new, live):
        install(src, dst)
    assert watcher.check()
    assert peer_serial(ctx, pki["ca"][0]) == serial_of(new[0])
    with pytest.raises(ssl.SSLError):
        peer_serial(ctx, pki["ca"][0], ecdsa_only)


def test_the_gateways_client_certificate_is_refreshed(pki, tmp_path):
    """The context the gateway shows workers (--worker-ssl-*): a rotated client certificate is what
    the next handshake presents; a half-written pair leaves the loaded one."""
    from ferry.entrypoints.tls import add_worker_tls_args, worker_client_tls

    old, new = (make_cert(tmp_path, n, pki["ca"], "clientAuth") for n in ("old", "new"))
    live = (str(tmp_path / "live.pem"), str(tmp_path / "live.key"))
    for src, dst in zip(old, live):
        shutil.copyfile(src, dst)
    p = argparse.ArgumentParser()
    add_worker_tls_args(p)
    ctx, files = worker_client_tls(p.parse_args(["--worker-ssl-ca-certs", pki["ca"][0], "--worker-ssl-certfile",
                                                 live[0], "--worker-ssl-keyfile", live[1]]))  # fmt: skip
    watcher = CertificateWatcher(files, ctx, "to workers")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(*pki["server"])
    server.load_verify_locations(pki["ca"][0])
    server.verify_mode = ssl.CERT_REQUIRED

    def presented() -> int | None:
        return handshake(server, ctx)[1]

    assert presented() == serial_of(old[0])
    install(new[0], live[0])  # the certificate, not yet its key
    assert not watcher.check() and presented() == serial_of(old[0])
    install(new[1], live[1])
    assert watcher.check() and presented() == serial_of(new[0])


@pytest.fixture(scope="module")
def tls_server(pki, tmp_path_factory):
    """`ferry serve` asking every client for a certificate of the test CA, watching its files, which
    are copies the refresh test rewrites."""
    d = tmp_path_factory.mktemp("served")
    cert, key = str(d / "server.pem"), str(d / "server.key")
    shutil.copyfile(pki["server"][0], cert)
    shutil.copyfile(pki["server"][1], key)
    s = ServerProcess("--max-model-len", "256", "--num-kv-blocks", "32", "--served-model-name", MODEL,
                      "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", pki["ca"][0],
                      "--ssl-cert-reqs", "2", "--enable-ssl-refresh",
                      tls=client_context(pki["ca"][0], pki["client"]))  # fmt: skip
    s.files = (cert, key)
    yield s
    s.stop()


def test_serve_speaks_https_to_clients_with_a_certificate_only(pki, tls_server):
    assert tls_server.url.startswith("https://127.0.0.1:")
    with httpx.Client(verify=client_context(pki["ca"][0], pki["client"]), timeout=60) as c:
        r = c.post(tls_server.url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
    refused = [
        client_context(pki["ca"][0]),  # no client certificate
        client_context(pki["ca"][0], pki["rogue"]),  # one of another CA
    ]
    for ctx in refused:
        with httpx.Client(verify=ctx, timeout=30) as c, pytest.raises(httpx.TransportError):
            c.get(tls_server.url + "/health")
    with pytest.raises(httpx.TransportError):  # plain HTTP gets no HTTP answer
        httpx.get(tls_server.url.replace("https://", "http://") + "/health", timeout=30)
    with httpx.Client(verify=client_context(pki["ca"][0], pki["client"]), timeout=30) as c:
        assert c.get(tls_server.url + "/health").status_code == 200  # none of that hurt it


def test_gateway_serves_https_over_an_https_worker(pki, tls_server):
    gw = GatewayProcess([tls_server.url], "--ssl-certfile", pki["server"][0], "--ssl-keyfile", pki["server"][1],
                        "--worker-ssl-ca-certs", pki["ca"][0], "--worker-ssl-certfile", pki["client"][0],
                        "--worker-ssl-keyfile", pki["client"][1], tls=client_context(pki["ca"][0]))  # fmt: skip
    try:
        with httpx.Client(verify=client_context(pki["ca"][0]), timeout=60) as c:
            r = c.post(gw.url + "/v1/completions", json=COMPLETION)
            assert r.status_code == 200, r.text
            assert r.headers["x-ferry-worker"] == tls_server.url
    finally:
        gw.stop()


def test_gateway_without_the_workers_ca_does_not_route_to_them(pki, tls_server):
    # The client certificate the worker asks for, but the system's CAs: the test CA is not one, so the
    # worker's certificate does not check out. (Held half a second for a ready worker: /ready is 200.)
    gw = GatewayProcess([tls_server.url], "--hold-timeout", "0.5", "--worker-ssl-certfile", pki["client"][0],
                        "--worker-ssl-keyfile", pki["client"][1])  # fmt: skip
    try:
        r = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=60)
        assert r.status_code == 503, r.text
    finally:
        gw.stop()


def test_serve_takes_rotated_certificates_for_new_connections(pki, tls_server, tmp_path):
    new = make_cert(tmp_path, "rotated", pki["ca"], "serverAuth")
    cert, key = tls_server.files
    install(new[1], key)
    install(new[0], cert)
    ctx = client_context(pki["ca"][0], pki["client"])

    def presented() -> int:
        with socket.create_connection(("127.0.0.1", tls_server.port), timeout=30) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                return int(tls.getpeercert()["serialNumber"], 16)

    wait_for(lambda: presented() == serial_of(new[0]), "the server presents the rotated certificate", timeout=60)
    with httpx.Client(verify=ctx, timeout=60) as c:
        assert c.post(tls_server.url + "/v1/completions", json=COMPLETION).status_code == 200
    with httpx.Client(verify=client_context(pki["ca"][0]), timeout=30) as c, pytest.raises(httpx.TransportError):
        c.get(tls_server.url + "/health")  # still no answer without a client certificate
    assert "TLS refresh (server): reloaded" in tls_server.logs()
