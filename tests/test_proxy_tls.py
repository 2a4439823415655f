"""HTTPS on the gateway's port (decision 0013): a throwaway CA and a certificate for 127.0.0.1 made
with the `openssl` command, the proxy serving with them, and the official `openai` SDK calling it
through a client that trusts that CA (and failing through one that does not)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest
from aiohttp import web

from tests.proxy_fakes import Stack, open_stack
from tests.test_proxy_workers import process_tree, until
from xhpc.errors import ConfigError
from xhpc.proxy import bound_url, make_app
from xhpc.proxy.process.server import app_runner
from xhpc.proxy.process.tls import proxy_context, server_context
from xhpc.settings import ProxyConfig, XhpcConfig

pytestmark = pytest.mark.security


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA's certificate (what a client trusts)
    cert: Path  # the server's certificate, for IP 127.0.0.1
    key: Path


def openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def make_pki(tmp: Path, name: str = "test") -> Pki:
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca, ca_key = tmp / f"{name}-ca.pem", tmp / f"{name}-ca.key"
    openssl(
        "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1",
        "-subj", f"/CN={name} CA", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=tmp,
    )  # fmt: skip
    key, csr, cert = tmp / f"{name}.key", tmp / f"{name}.csr", tmp / f"{name}.pem"
    openssl("req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1", cwd=tmp)
    ext = tmp / f"{name}.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\n"
    )
    openssl(
        "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", cert, "-days", "1", "-extfile", ext, cwd=tmp,
    )  # fmt: skip
    key.chmod(0o600)
    return Pki(ca, cert, key)


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        await s.engine("a")
        s.publish("a")
        yield s


@contextlib.asynccontextmanager
async def https_gateway(stack: Stack, pki: Pki) -> AsyncIterator[str]:
    """The stack's router served as `xhpc proxy` serves it, with TLS; yields its URL."""
    proxy = ProxyConfig(auth="none", tls_cert_file=pki.cert, tls_key_file=pki.key)
    config = XhpcConfig(proxy=proxy)
    tls = proxy_context(proxy)
    assert tls is not None
    runner = app_runner(make_app(stack.router, config=proxy), config, 1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
        yield bound_url(runner, tls=True)
    finally:
        await runner.cleanup()


def chat_through_sdk(url: str, verify: ssl.SSLContext | bool) -> str | None:
    client = openai.OpenAI(
        base_url=url + "/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx2.Client(verify=verify),
    )
    with client:
        answer = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    return answer.choices[0].message.content


async def test_the_sdk_trusting_the_ca_chats_over_https(stack: Stack, pki: Pki) -> None:
    async with https_gateway(stack, pki) as url:
        assert url.startswith("https://127.0.0.1:")
        content = await asyncio.to_thread(chat_through_sdk, url, trusting(pki.ca))
    assert content == "hello from a"
    assert len(stack.engines["a"].received) == 1


async def test_a_client_that_does_not_trust_the_ca_fails_verification(
    stack: Stack, pki: Pki, tmp_path: Path
) -> None:
    other = make_pki(tmp_path, "other")
    async with https_gateway(stack, pki) as url:
        for verify in (trusting(other.ca), True):  # another CA; the system's CAs
            with pytest.raises(openai.APIConnectionError) as caught:
                await asyncio.to_thread(chat_through_sdk, url, verify)
            assert "CERTIFICATE_VERIFY_FAILED" in repr(caught.value.__cause__)
        with pytest.raises(openai.APIConnectionError):  # plain HTTP to the HTTPS port
            await asyncio.to_thread(chat_through_sdk, url.replace("https", "http"), False)
    assert stack.engines["a"].received == []


async def test_workers_each_serve_https_on_the_socket_their_supervisor_passed(
    pki: Pki, tmp_path: Path
) -> None:
    tls = f'tls_cert_file = "{pki.cert}"\ntls_key_file = "{pki.key}"\n'
    with process_tree(tmp_path, tokens=4, interval_ms=5, proxy_toml=tls) as tree:
        assert tree.url.startswith("https://127.0.0.1:")
        want = "Hello! How can I help you today?"  # the backend's answer
        for _ in range(4):  # a new connection each: both workers take some
            assert await asyncio.to_thread(chat_through_sdk, tree.url, trusting(pki.ca)) == want
        old = tree.workers()
        tree.proxy.send_signal(signal.SIGHUP)  # new workers load the files again
        await until(lambda: tree.logged("reload: new workers ready"), "the new workers")
        await until(lambda: not tree.workers() & old, "the old workers to exit")
        assert await asyncio.to_thread(chat_through_sdk, tree.url, trusting(pki.ca)) == want
        with pytest.raises(openai.APIConnectionError):
            await asyncio.to_thread(chat_through_sdk, tree.url, True)
        assert tree.logged("serving on https://127.0.0.1:")


def test_the_context_speaks_tls_1_2_or_later_and_http_1_1(pki: Pki) -> None:
    ctx = server_context(pki.cert, pki.key)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE  # clients present no certificate


def test_a_bad_pair_is_refused_at_start(pki: Pki, tmp_path: Path) -> None:
    other = make_pki(tmp_path, "other")
    with pytest.raises(ConfigError, match="cannot use the TLS certificate"):
        server_context(pki.cert, other.key)  # not its key
    encrypted = tmp_path / "encrypted.key"
    openssl(
        "pkey", "-in", pki.key, "-aes256", "-passout", "pass:secret", "-out", encrypted,
        cwd=tmp_path,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="cannot use the TLS certificate"):
        server_context(pki.cert, encrypted)  # never asks for a password


def test_tls_settings_are_checked_when_the_config_loads(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="set both tls_cert_file and tls_key_file"):
        ProxyConfig(tls_cert_file=pki.cert)
    with pytest.raises(ValueError, match="must be an absolute path"):
        ProxyConfig(tls_cert_file=Path("cert.pem"), tls_key_file=pki.key)
    # A member loads the site file too, and may not read the gateway's key: the files are
    # opened by the gateway when it starts, with one line naming them when it cannot.
    missing = ProxyConfig(tls_cert_file=tmp_path / "missing.pem", tls_key_file=pki.key)
    with pytest.raises(ConfigError, match="cannot use the TLS certificate"):
        proxy_context(missing)
    assert ProxyConfig(tls_cert_file=pki.cert, tls_key_file=pki.key).tls == (pki.cert, pki.key)
    assert ProxyConfig().tls is None
