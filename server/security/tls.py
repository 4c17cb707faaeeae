"""TLS for a listener: server credentials whose files are re-read when they change.

A ``tls:`` entry names a certificate chain, its key and optionally a
``client_ca``; with ``client_ca`` a client must present a certificate signed by
that CA (mTLS). gRPC asks ``CertificateReloader.fetch`` for the configuration
at every new handshake (``grpc.dynamic_ssl_server_credentials``); it returns a
new one only when a file's stamp (inode, size, mtime) changed, so certificates
rotate without a restart and established connections keep theirs. Files that
cannot be read or do not look like PEM keep the last good configuration and
log why; at start they are an error (``TlsConfigError``).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import grpc

from loaderd.server.config.schema import TlsSpec

log = logging.getLogger("loaderd.tls")

MAX_PEM_BYTES = 1 << 20


class TlsConfigError(Exception):
    """A listener's TLS files cannot be used; the message names the file."""


def _read_pem(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise TlsConfigError(f"tls.{what}: cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PEM_BYTES or b"-----BEGIN " not in data:
        raise TlsConfigError(f"tls.{what}: {path} is not a PEM file")
    return data


def _stamp(paths: tuple[Path, ...]) -> tuple[tuple[int, int, int], ...]:
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            stamps.append((0, 0, 0))
    return tuple(stamps)


class CertificateReloader:
    """The certificate configuration of one listener, re-read when its files change."""

    def __init__(self, files: TlsSpec) -> None:
        """Read the files now; TlsConfigError if one cannot be used."""
        self.files = files
        self._paths = tuple(p for p in (files.cert, files.key, files.client_ca) if p is not None)
        self._lock = threading.Lock()
        self._stamp = _stamp(self._paths)
        self.initial = self._load()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert = _read_pem(self.files.cert, "cert")
        key = _read_pem(self.files.key, "key")
        ca = _read_pem(self.files.client_ca, "client_ca") if self.files.client_ca is not None else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC at each handshake: a new configuration if a file changed, else None."""
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return None
        with self._lock:
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                config = self._load()
            except TlsConfigError as exc:
                log.error("%s; new connections keep the certificate read before", exc)
                return None
            log.info("certificate files for %s changed; new connections use them", self.files.cert)
            return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=self.files.client_ca is not None
        )
