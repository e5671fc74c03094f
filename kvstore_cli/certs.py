"""``kvstore certs``: a private CA and certificates signed by it, for a cluster's TLS.

One CA per cluster (``ca.pem``, ``ca.key``, made on first use and kept); one certificate per
process or host, named for the addresses peers reach it at (IP addresses and DNS names, as
subject alternative names) and good as both server and client certificate, so that the same
file serves a daemon's port and its connections to the master. Needs the ``cryptography``
package (``pip install 'kvstore[tls]'``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.config import TlsConfig
from kvstore.errors import ConfigError

_DAYS = 825


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    cert: Path
    key: Path

    def config(self, *, data_plane: bool = False, verify_clients: bool = False) -> TlsConfig:
        return TlsConfig(cert_file=str(self.cert), key_file=str(self.key), ca_file=str(self.ca),
                         data_plane=data_plane, verify_clients=verify_clients)  # fmt: skip


def _crypto() -> Any:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ConfigError("making certificates needs the cryptography package: pip install 'kvstore[tls]'") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_key(path: Path, key: Any, serialization: Any) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_certs(directory: str | os.PathLike[str], name: str, hosts: list[str]) -> CertFiles:
    """A certificate ``NAME.pem`` (key ``NAME.key``) for ``hosts``, signed by the directory's CA
    (made first if there is none). ConfigError for a bad host or an unreadable CA."""
    if not hosts:
        raise ConfigError("a certificate needs at least one host (IP address or DNS name) peers reach it at")
    if name == "ca" or not name or any(c in name for c in "/\\\0") or name.startswith("."):
        raise ConfigError(f"certificate name {name!r}: a plain file name, not 'ca' (the CA's own files)")
    x509, hashes, serialization, ec, eku, oid = _crypto()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_cert_path, ca_key_path = d / "ca.pem", d / "ca.key"
    if ca_cert_path.exists() != ca_key_path.exists():
        raise ConfigError(f"{d} holds one of ca.pem and ca.key, not both: put the other back (a new CA would"
                          " void every certificate the old one signed)")  # fmt: skip
    if ca_cert_path.exists():
        try:
            ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
            ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"the CA in {d}: {exc}") from None
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(oid.COMMON_NAME, f"kvstore CA {d.name}")])
        ca_cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(ca_key, hashes.SHA256())
        )  # fmt: skip
        _write_key(ca_key_path, ca_key, serialization)
        ca_cert_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    names: list[Any] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or any(c.isspace() or c in "/:" for c in host):
                raise ConfigError(f"{host!r} is neither an IP address nor a DNS name") from None
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(oid.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([eku.SERVER_AUTH, eku.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = d / f"{name}.pem", d / f"{name}.key"
    _write_key(key_path, key, serialization)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return CertFiles(ca_cert_path, cert_path, key_path)
