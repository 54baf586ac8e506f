"""TLS shared by the server, clients and agents: self-signed pairs, fingerprints, verifying contexts.

`cpool up` makes a self-signed pair on first start (EC P-256 with the `cryptography` package, the
key 0600). Clients trust it through `--ca`/`CPOOL_CA` (the certificate itself is the CA). A join
token carries the certificate's SHA-256 fingerprint as a suffix (`<id>.<secret>.sha256-<hex>`),
so an agent that has nothing yet can pin the certificate it first meets, and keep it as its CA.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
import re
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

PIN_PREFIX = ".sha256-"
_PIN = re.compile(r"^(?P<token>.+)\.sha256-(?P<fp>[0-9a-f]{64})$")
CERT_DAYS = 825


class TlsError(ValueError):
    """A certificate or key that cannot be used, or a server that is not the one pinned."""


def first_certificate_der(pem: str) -> bytes:
    """The first certificate of a PEM text, as DER (what fingerprints are taken of)."""
    m = re.search(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", pem, re.DOTALL)
    if not m:
        raise TlsError("no PEM certificate found")
    return ssl.PEM_cert_to_DER_cert(m.group(0))


def fingerprint(pem: str) -> str:
    """SHA-256 of the first certificate's DER bytes, lower-case hex (as `openssl x509 -fingerprint`)."""
    return hashlib.sha256(first_certificate_der(pem)).hexdigest()


def file_fingerprint(path: Path) -> str:
    try:
        return fingerprint(path.read_text())
    except (OSError, ValueError, TlsError) as e:
        raise TlsError(f"{path}: not a PEM certificate ({e})") from None


def with_pin(token: str, fp: str) -> str:
    return f"{token}{PIN_PREFIX}{fp}"


def split_pin(token: str) -> tuple[str, str | None]:
    """(the join token proper, the pinned fingerprint or None): tokens without a pin still work."""
    m = _PIN.match(token.strip())
    return (m.group("token"), m.group("fp")) if m else (token.strip(), None)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)
    os.replace(tmp, path)


def generate_self_signed(cert_path: Path, key_path: Path, hosts: Sequence[str]) -> None:
    """A certificate valid for `hosts` (names and addresses) that is its own CA; key file 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"computepool {socket.gethostname()}")])
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_private(key_path, key_pem)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def check_pair(cert: Path, key: Path) -> None:
    """Raise TlsError naming the file when the certificate and key cannot serve together."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise TlsError(f"--tls-cert/--tls-key: {cert} and {key} do not load as a pair ({e})") from None


def client_context(ca: Path | None, *, pinned: bool = False) -> ssl.SSLContext | bool:
    """What httpx's `verify` takes: the system's CAs (True), or `ca` as the trust anchor.

    A certificate in `ca` counts as trusted even when it is not self-signed (partial chain), so a
    pinned server certificate works as its own anchor; with `pinned` the name is not checked
    either, since only that exact certificate (its key) can pass.
    """
    if ca is None:
        return True
    try:
        ctx = ssl.create_default_context(cafile=str(ca))
    except (OSError, ssl.SSLError) as e:
        raise TlsError(f"CA file {ca}: cannot be read as PEM certificates ({e})") from None
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    if pinned:
        ctx.check_hostname = False
    return ctx


def fetch_certificate(url: str, timeout_s: float = 10.0) -> str:
    """The PEM certificate an https:// server presents, unverified (to be checked against a pin)."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise TlsError(f"{url}: a pinned join needs an https:// server URL")
    try:
        return ssl.get_server_certificate((parts.hostname, parts.port or 443), timeout=timeout_s)
    except (OSError, ssl.SSLError) as e:
        raise TlsError(f"{url}: could not fetch the server certificate ({e})") from None


def describe_tls_failure(error: object) -> str | None:
    """A readable line for a certificate that did not verify, or None when `error` is not that."""
    text = str(error)
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        reason = text.split("certificate verify failed:", 1)[-1].split("(_ssl", 1)[0].strip(" )")
        return (
            f"the server's TLS certificate is not trusted ({reason or 'verify failed'}): "
            "give its CA with --ca FILE or CPOOL_CA"
        )
    return None
