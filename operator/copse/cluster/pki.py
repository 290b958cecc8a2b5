"""Certificates and credentials of the local API server, made with the openssl CLI.

A generated CA signs the API server's serving certificate; clients authenticate with a
static bearer token (``system:masters``); one RSA key signs and verifies service-account tokens.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from copse.cluster.errors import ClusterError, ToolNotFoundError

APISERVER_SANS = (
    "IP:127.0.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)
"""Names the serving certificate must cover: loopback for us, the in-cluster names for pods' clients."""


@dataclass(frozen=True)
class Pki:
    """Files and secrets the components are started with."""

    directory: Path
    """Where every file below lives (the cluster work dir's ``pki/``)."""
    token: str
    """The admin bearer token written to the kubeconfig and the token file."""

    @property
    def ca_crt(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def apiserver_crt(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def service_account_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def token_file(self) -> Path:
        return self.directory / "tokens.csv"


def san_extension(*, service_ip: str) -> str:
    """The openssl ``-extfile`` text for the API server's serving certificate."""
    names = ",".join((*APISERVER_SANS, f"IP:{service_ip}"))
    return (
        f"subjectAltName={names}\n"
        "extendedKeyUsage=serverAuth\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
    )


def token_file_line(token: str) -> str:
    """A static token file row: token, user, uid, groups (kube-apiserver --token-auth-file)."""
    return f'{token},copse-admin,copse-admin,"system:masters"\n'


def _openssl(openssl: str, *args: str, cwd: Path) -> None:
    completed = subprocess.run(
        [openssl, *args], cwd=cwd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
    )
    if completed.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args)} failed in {cwd}:\n{completed.stderr.strip()}")


def generate_pki(directory: Path, *, service_ip: str) -> Pki:
    """Create a CA, the API server certificate, a service-account key and an admin token."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ToolNotFoundError(tool="openssl", purpose="generate the local API server's certificates")
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory=directory, token=secrets.token_hex(16))
    _openssl(
        openssl,
        *("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=copse-local-ca"),
        *("-keyout", pki.ca_key.name, "-out", pki.ca_crt.name),
        *("-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"),
        cwd=directory,
    )
    _openssl(
        openssl,
        *("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver"),
        *("-keyout", pki.apiserver_key.name, "-out", "apiserver.csr"),
        cwd=directory,
    )
    (directory / "apiserver.ext").write_text(san_extension(service_ip=service_ip))
    _openssl(
        openssl,
        *("x509", "-req", "-in", "apiserver.csr", "-CA", pki.ca_crt.name, "-CAkey", pki.ca_key.name),
        *("-CAcreateserial", "-days", "3650", "-out", pki.apiserver_crt.name, "-extfile", "apiserver.ext"),
        cwd=directory,
    )
    _openssl(openssl, "genrsa", "-out", pki.service_account_key.name, "2048", cwd=directory)
    pki.token_file.write_text(token_file_line(pki.token))
    for secret in (pki.ca_key, pki.apiserver_key, pki.service_account_key, pki.token_file):
        secret.chmod(0o600)
    return pki
