"""HTTPS on the gateway's port (``[proxy] tls_cert_file``, ``tls_key_file``; decision 0013).

Each process that serves builds its own context from the files: the single process, or every
worker on the socket its supervisor passed down (a reload reads the files again, so a renewed
certificate is taken up by SIGHUP). The supervisor builds one once, before starting workers,
to refuse a broken pair at start.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

from xhpc.errors import ConfigError
from xhpc.settings import ProxyConfig

logger = logging.getLogger(__name__)

ALPN = ["http/1.1"]  # the gateway speaks HTTP/1.1 only


def _no_password() -> str:
    return ""  # an encrypted key fails to load instead of asking on a terminal


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context for ``cert`` (PEM, the server's certificate first, then its chain) and
    ``key`` (PEM, unencrypted): TLS 1.2 or later, Python's default ciphers."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(ALPN)
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except (ssl.SSLError, OSError) as err:
        raise ConfigError(
            f"the proxy cannot use the TLS certificate {cert} with the key {key}: {err}",
            hint="proxy.tls_cert_file and tls_key_file: PEM files, the key unencrypted and "
            "the certificate's own",
        ) from err
    if key.stat().st_mode & 0o077:
        logger.warning("the proxy's TLS key %s is readable by other users (chmod 600 it)", key)
    return ctx


def proxy_context(config: ProxyConfig) -> ssl.SSLContext | None:
    """The gateway's TLS context, or None when it serves plain HTTP."""
    files = config.tls
    return None if files is None else server_context(*files)
