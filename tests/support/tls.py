"""A throwaway certificate authority for the TLS tests, made with the
``openssl`` command line (no Python crypto package is a dependency): a CA,
a server certificate naming 127.0.0.1 and localhost, and one naming another
host, each with its private key, in a directory of the test's."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

# One key type for all: P-256 keys are made in milliseconds, RSA ones take longer.
_NEW_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_SERVER_EXTENSIONS = (
    "basicConstraints = critical, CA:FALSE\n"
    "keyUsage = critical, digitalSignature, keyEncipherment\n"
    "extendedKeyUsage = serverAuth\n"
    "subjectKeyIdentifier = hash\n"
    "authorityKeyIdentifier = keyid\n"
    "subjectAltName = {names}\n"
)


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True)
class Authority:
    ca: Path  # the CA certificate, what clients are given
    server: Pair  # names 127.0.0.1 and localhost
    wrong_host: Pair  # signed by the same CA, for another host only


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        pytest.skip("the openssl command is not installed")
    done = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"openssl {args[0]} failed: {done.stderr}"


def _server_pair(directory: Path, name: str, subject: str, names: str) -> Pair:
    pair = Pair(directory / f"{name}.pem", directory / f"{name}.key")
    (directory / f"{name}.ext").write_text(_SERVER_EXTENSIONS.format(names=names))
    _openssl("req", "-new", *_NEW_KEY, "-keyout", pair.key.name, "-out", f"{name}.csr",
             "-subj", f"/CN={subject}", cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-sha256", "-extfile", f"{name}.ext",
             "-out", pair.cert.name, cwd=directory)  # fmt: skip
    pair.key.chmod(0o600)
    return pair


def make_authority(directory: Path) -> Authority:
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_NEW_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=Switchboard test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)  # fmt: skip
    return Authority(
        ca=directory / "ca.pem",
        server=_server_pair(directory, "server", "localhost", "IP:127.0.0.1, DNS:localhost"),
        wrong_host=_server_pair(directory, "wrong-host", "db.example", "DNS:db.example"),
    )
