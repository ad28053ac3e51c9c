"""`sluice deploy certs`: a private CA and the bundled Redis's certificate, for
``deploy.redis_tls_dir`` (sluice.deploy.tls).

Writes ``ca.crt`` / ``ca.key`` (the CA: keep ``ca.key`` off the cluster; the render never
reads it) and ``redis.crt`` / ``redis.key`` (the server, signed by the CA, naming every
``--host``: DNS names and IP addresses alike), EC P-256 keys, keys at mode 0600. Refuses
a folder that already holds any of them, so a CA the roles trust is never replaced by
accident.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from sluice.deploy.tls import is_ip

FILES = ("ca.crt", "ca.key", "redis.crt", "redis.key")


def make_certs(out: str | Path, hosts: Sequence[str], days: int = 365) -> list[Path]:
    """Write the four files of the module docstring under ``out``; returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("sluice deploy certs: give at least one --host (the address the "
                         "roles reach Redis at)")
    if days < 1:
        raise ValueError(f"sluice deploy certs: --days must be at least 1, not {days}")
    root = Path(out)
    taken = [f for f in FILES if (root / f).exists()]
    if taken:
        raise FileExistsError(f"sluice deploy certs: {root} already holds {', '.join(taken)}; "
                              "choose another folder (replacing a CA the roles trust "
                              "breaks every running role)")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sluice Redis CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    alt = [x509.IPAddress(ipaddress.ip_address(h)) if is_ip(h) else x509.DNSName(h)
           for h in dict.fromkeys(hosts)]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    plain = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    texts = {"ca.crt": ca.public_bytes(pem), "redis.crt": cert.public_bytes(pem),
             "ca.key": ca_key.private_bytes(pem, pkcs8, plain),
             "redis.key": key.private_bytes(pem, pkcs8, plain)}
    written = []
    for name in FILES:
        path = root / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                     0o600 if name.endswith(".key") else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(texts[name])
        written.append(path)
    return written
