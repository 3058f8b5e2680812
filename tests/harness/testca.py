"""A throwaway certificate authority for TLS test servers (the secrets' injector tests): an EC
P-256 CA with path length 0 and leaf certificates for one host each, valid for a day."""

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _validity(builder):
    now = datetime.datetime.now(datetime.timezone.utc)
    return (builder.serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1)))


def make_ca(name):
    """A self-signed CA named `name`: (key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subj = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_validity(x509.CertificateBuilder().subject_name(subj).issuer_name(subj)
                      .public_key(key.public_key()))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_leaf(ca_key, ca_cert, host):
    """A certificate for `host` (CN and DNS SAN) signed by the CA: (key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_validity(x509.CertificateBuilder()
                      .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
                      .issuer_name(ca_cert.subject).public_key(key.public_key()))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def pem_cert(cert):
    return cert.public_bytes(serialization.Encoding.PEM)


def pem_key(key):
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
