"""An OpenAI-compatible endpoint and the openai SDK's clients for it (the SDK loaded on use)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xhpc.errors import XhpcError

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI


class Endpoint:
    """Where a model answers (``base_url`` ends in ``/v1``) and the key it wants."""

    base_url: str
    api_key: str

    def openai(self, **kwargs: Any) -> OpenAI:
        """An ``openai.OpenAI`` client for this endpoint; keyword arguments go to its
        constructor."""
        client: OpenAI = _openai().OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)
        return client

    def async_openai(self, **kwargs: Any) -> AsyncOpenAI:
        """The same as ``openai``, for asyncio code."""
        sdk = _openai()
        client: AsyncOpenAI = sdk.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, **kwargs
        )
        return client


def _openai() -> Any:
    try:
        import openai
    except ImportError as err:
        raise XhpcError("the openai package is not installed", hint="pip install openai") from err
    return openai
