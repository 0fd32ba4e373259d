"""Opt-in encryption between hosts: mutual TLS with a per-job certificate (``horovodrun --tls``).

The launcher makes one self-signed certificate and private key per job (:func:`make_credentials`, needs
the ``cryptography`` package: ``pip install 'horovod[tls]'``) and ships both to every worker the way the
job key travels -- in the environment of local workers (``HOROVOD_TLS_CERT``, ``HOROVOD_TLS_KEY``), inside
the ssh connection (stdin of the remote watchdog) for remote ones, never on a command line.  Workers need
nothing beyond Python's :mod:`ssl`.

Every TLS connection of the job (rendezvous store, TCP mesh channels) is mutual: both sides present the
job certificate and require the peer's to be exactly it.  The certificate is its own and only trust anchor
(nothing else is loaded), host names are not checked (the pin is the identity) and the peer's certificate
is compared byte for byte after the handshake.  TLS 1.3 only; no session tickets (a ticket arriving after
the handshake would make a selector report a socket readable with no application data behind it).

The job key's HMAC handshakes and signatures run unchanged inside the TLS streams, so TLS adds
confidentiality and per-record integrity without replacing any check.  Same-host AF_UNIX channels and
shared memory stay in clear: that traffic never leaves the kernel.

The private key is loaded into OpenSSL through an anonymous in-memory file (``memfd``), so it is never
written to a file system; :class:`JobCredentials` never shows it in ``repr`` or tracebacks.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import os
import socket
import ssl
from collections.abc import Mapping

from horovod.base.config import EnvVarError, read_env

__all__ = ["JobCredentials", "JobTls", "TlsError", "make_credentials", "credentials_from_env", "job_tls",
           "resolve", "worker_env", "TLS_ENV", "CERT_ENV", "KEY_ENV", "INSTALL_HINT"]

TLS_ENV = "HOROVOD_TLS"
CERT_ENV = "HOROVOD_TLS_CERT"
KEY_ENV = "HOROVOD_TLS_KEY"
INSTALL_HINT = "pip install 'horovod[tls]' (or pip install 'cryptography>=41')"


class TlsError(ssl.SSLError):
    """The peer completed a TLS handshake but did not present this job's certificate."""


@dataclasses.dataclass(frozen=True)
class JobCredentials:
    """The job's certificate and private key, PEM.  ``repr`` shows the certificate's fingerprint only."""

    cert_pem: bytes
    key_pem: bytes = dataclasses.field(repr=False)

    @functools.cached_property
    def cert_der(self) -> bytes:
        return ssl.PEM_cert_to_DER_cert(self.cert_pem.decode("ascii"))

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the certificate (hex): safe to log, names the job's certificate."""
        return hashlib.sha256(self.cert_der).hexdigest()

    def __repr__(self) -> str:
        return f"JobCredentials(sha256={self.fingerprint[:16]}...)"


def make_credentials(common_name: str = "horovod-job") -> JobCredentials:
    """A fresh self-signed ECDSA P-256 certificate and key for one job (the launcher calls this).

    The certificate is a CA for itself only (``pathlen=0``) and valid for client and server use; its
    validity starts a day back so that hosts whose clocks lag the launcher's still accept it.

    Raises:
        RuntimeError: the ``cryptography`` package is missing (the text says how to install it).
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:
        raise RuntimeError(f"--tls (HOROVOD_TLS=1) needs the 'cryptography' package on the launcher's host to "
                           f"make the job's certificate: {INSTALL_HINT}") from e
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA256()))
    return JobCredentials(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption()))


def worker_env(creds: JobCredentials) -> dict[str, str]:
    """The variables that give a worker the job's TLS identity (they travel like ``HOROVOD_SECRET_KEY``)."""
    return {TLS_ENV: "1", CERT_ENV: creds.cert_pem.decode("ascii"), KEY_ENV: creds.key_pem.decode("ascii")}


def credentials_from_env(environ: Mapping[str, str] | None = None) -> JobCredentials | None:
    """The job's credentials when ``HOROVOD_TLS`` is on, else None.

    Raises:
        EnvVarError: ``HOROVOD_TLS`` is on but the certificate or key is missing or not PEM (the text names
            the variable, never the key).
    """
    if not read_env(TLS_ENV, environ):
        return None
    cert, key = read_env(CERT_ENV, environ).strip(), read_env(KEY_ENV, environ).strip()
    for name, text, kind in ((CERT_ENV, cert, "CERTIFICATE"), (KEY_ENV, key, "PRIVATE KEY")):
        if not text:
            raise EnvVarError(name, "", f"is not set but {TLS_ENV}=1: the job certificate and key come from "
                              "'horovodrun --tls' (TLS is not available under mpirun/srun)", show_value=False)
        if f"-----BEGIN {kind}-----" not in text:
            raise EnvVarError(name, text, f"is not a PEM {kind.lower()} (it is set by 'horovodrun --tls')",
                              show_value=False)
    return JobCredentials(cert.encode("ascii") + b"\n", key.encode("ascii") + b"\n")


class JobTls:
    """SSL contexts of one job's identity: wrap sockets as server or client and check the pin.

    Example::

        tls = JobTls(make_credentials())
        conn = tls.server_socket(accepted, handshake=False)   # then conn.do_handshake() when readable
        sock = tls.client_socket(socket.create_connection(addr, timeout=5))
    """

    def __init__(self, creds: JobCredentials) -> None:
        self.creds = creds
        self.server_context = self._context(ssl.PROTOCOL_TLS_SERVER)
        self.client_context = self._context(ssl.PROTOCOL_TLS_CLIENT)

    def __repr__(self) -> str:
        return f"JobTls({self.creds!r})"

    def _context(self, protocol: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=self.creds.cert_pem.decode("ascii"))  # the only trust anchor
        _load_chain(ctx, self.creds)
        if protocol == ssl.PROTOCOL_TLS_SERVER:
            ctx.num_tickets = 0
        return ctx

    def check_peer(self, sock: ssl.SSLSocket) -> None:
        """After the handshake: the peer's certificate must be this job's, byte for byte.

        Raises:
            TlsError: it is not (cannot happen without the job's private key; a second line of defence).
        """
        if sock.getpeercert(binary_form=True) != self.creds.cert_der:
            raise TlsError("the peer's TLS certificate is not this job's")

    def server_socket(self, sock: socket.socket) -> ssl.SSLSocket:
        """Wrap an accepted socket; the caller drives ``do_handshake()`` (non-blocking) and :meth:`check_peer`."""
        _no_delay(sock)
        return self.server_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)

    def client_socket(self, sock: socket.socket) -> ssl.SSLSocket:
        """Wrap a connected socket and complete the handshake within the socket's timeout; pin checked.

        Raises:
            ssl.SSLError: the handshake failed (e.g. the server's certificate is not the job's: a
                ``ssl.SSLCertVerificationError``), or :class:`TlsError`.
            OSError: the connection failed or timed out.
        """
        _no_delay(sock)
        wrapped = self.client_context.wrap_socket(sock, server_side=False, do_handshake_on_connect=False)
        try:
            wrapped.do_handshake()
            self.check_peer(wrapped)
        except BaseException:
            wrapped.close()
            raise
        return wrapped


def _no_delay(sock: socket.socket) -> None:
    # OpenSSL writes a handshake flight (and a record per send) in several small writes: with Nagle's
    # algorithm each later one waits for the peer's delayed ACK (40 ms per round trip on Linux).
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _load_chain(ctx: ssl.SSLContext, creds: JobCredentials) -> None:
    # ssl only loads keys from a path: give it an anonymous memory file, never a file on disk.
    fd = os.memfd_create("horovod-tls", os.MFD_CLOEXEC)
    try:
        data = memoryview(creds.cert_pem + creds.key_pem)
        while data:
            data = data[os.write(fd, data):]
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=4)
def _job_tls(creds: JobCredentials) -> JobTls:
    return JobTls(creds)


def job_tls(environ: Mapping[str, str] | None = None) -> JobTls | None:
    """This process's :class:`JobTls` from the environment (cached), or None when TLS is off.

    Raises:
        EnvVarError: ``HOROVOD_TLS`` is on without usable credentials.
    """
    creds = credentials_from_env(environ)
    return None if creds is None else _job_tls(creds)


def resolve(tls: JobTls | bool | None) -> JobTls | None:
    """The ``tls=`` argument of the store client and ``build_mesh``: None = from the environment,
    False = off, a :class:`JobTls` = on with that identity."""
    if tls is None:
        return job_tls()
    if tls is False:
        return None
    if tls is True:
        found = job_tls()
        if found is None:
            raise ValueError(f"tls=True but {TLS_ENV} is not on in the environment")
        return found
    return tls
