"""A throw-away PKI for the local API server, made with the ``openssl`` command.

EC P-256 keys: generating them takes milliseconds (RSA 2048 takes ~10x longer), and Kubernetes
accepts ECDSA for serving certificates and for service-account token signing (ES256).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_SANS = (
    "IP:127.0.0.1",
    "IP:10.0.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    sa_key: Path  # private key: signs service-account tokens
    sa_pub: Path  # public key: verifies them


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if not openssl:
        raise RuntimeError("openssl not found: install Debian's openssl package")
    res = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {res.stderr.strip()}")


def _ec_key(path: Path) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        str(path),
        cwd=path.parent,
    )


def make_pki(directory: Path) -> Pki:
    """Write a CA, a serving certificate for the API server (loopback SANs) and SA keys."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory
    _ec_key(d / "ca.key")
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-days",
        "30",
        "-subj",
        "/CN=moe-localkube-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-out",
        "ca.crt",
        cwd=d,
    )
    _ec_key(d / "server.key")
    (d / "server.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName={','.join(SERVER_SANS)}\n"
    )
    _openssl(
        "req",
        "-new",
        "-key",
        "server.key",
        "-subj",
        "/CN=kube-apiserver",
        "-out",
        "server.csr",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "30",
        "-extfile",
        "server.ext",
        "-out",
        "server.crt",
        cwd=d,
    )
    _ec_key(d / "sa.key")
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    return Pki(
        ca_cert=d / "ca.crt",
        ca_key=d / "ca.key",
        server_cert=d / "server.crt",
        server_key=d / "server.key",
        sa_key=d / "sa.key",
        sa_pub=d / "sa.pub",
    )
