"""Reading the proxy's ``/metrics`` (Prometheus text) for `xhpc top`: one bounded GET, no key.

The address is ``proxy.metrics_listen`` when the site sets it (served with no key, for a lab's
Prometheus), else the gateway's own port, whose ``/metrics`` needs an admin key when
``proxy.auth = "keys"``: `xhpc top` sends none (a key never leaves its holder's programs), so
there it says so and draws no traffic.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from urllib.parse import urlsplit

from xhpc.errors import XhpcError
from xhpc.settings import ProxyConfig

MAX_METRICS_BYTES = 16 * 1024 * 1024
ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def _url(scheme: str, host: str, port: int) -> str:
    host = ANY_ADDRESS.get(host, host)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def metrics_url(proxy: ProxyConfig) -> str | None:
    """Where this site's proxy serves /metrics; None when it cannot be known (port 0)."""
    listen = proxy.metrics_address
    if listen is not None:
        return _url("http", *listen)
    if proxy.port == 0:
        return None
    return _url("https" if proxy.tls else "http", proxy.host, proxy.port)


def scrape(url: str, timeout_s: float = 2.0) -> str:
    """The text at ``url`` (http or https), at most MAX_METRICS_BYTES; XhpcError
    otherwise. Proxy variables of the environment are ignored: the proxy is on this site."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise XhpcError(f"not an http(s) URL: {url!r}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with opener.open(request, timeout=timeout_s) as answer:
            body: bytes = answer.read(MAX_METRICS_BYTES + 1)
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise XhpcError(
                f"{url} needs an admin key (HTTP {err.code})",
                hint="set proxy.metrics_listen to serve /metrics with no key on a private address",
            ) from err
        raise XhpcError(f"{url} answered HTTP {err.code}") from err
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise XhpcError(f"cannot read {url}: {reason}") from err
    if len(body) > MAX_METRICS_BYTES:
        raise XhpcError(f"{url} sent more than {MAX_METRICS_BYTES} bytes")
    return body.decode("utf-8", errors="replace")
