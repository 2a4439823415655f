"""An OpenAI-compatible endpoint and the openai SDK's clients for it (the SDK loaded on use)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xhpc.errors import XhpcError

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI


class Endpoint:
    """Where a model answers (``base_url`` ends in ``/v1``) and the key it wants; with
    ``fallbacks``, the same endpoint at other gateways (``[proxy] gateways``), tried in turn
    when one cannot be reached (``xhpc.client.failover``)."""

    base_url: str
    api_key: str
    fallbacks: tuple[str, ...] = ()

    def openai(self, **kwargs: Any) -> OpenAI:
        """An ``openai.OpenAI`` client for this endpoint; keyword arguments go to its
        constructor."""
        sdk = _openai()
        if self.fallbacks and "http_client" not in kwargs:
            kwargs["http_client"] = sdk.DefaultHttpxClient(transport=self._transports(sdk)[0])
        client: OpenAI = sdk.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)
        return client

    def async_openai(self, **kwargs: Any) -> AsyncOpenAI:
        """The same as ``openai``, for asyncio code."""
        sdk = _openai()
        if self.fallbacks and "http_client" not in kwargs:
            transport = self._transports(sdk)[1]
            kwargs["http_client"] = sdk.DefaultAsyncHttpxClient(transport=transport)
        client: AsyncOpenAI = sdk.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, **kwargs
        )
        return client

    def _transports(self, sdk: Any) -> tuple[Any, Any]:
        from xhpc.client.failover import Rotation, sdk_httpx, transports

        return transports(sdk_httpx(sdk), Rotation((self.base_url, *self.fallbacks)))


def _openai() -> Any:
    try:
        import openai
    except ImportError as err:
        raise XhpcError("the openai package is not installed", hint="pip install openai") from err
    return openai
