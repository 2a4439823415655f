"""The broker's control API as a Python client: one code path for the CLI and for programs.

``Client`` (xhpc.client.control) types each call with xhpc's models and waits for states;
``BrokerTransport`` (xhpc.client.http) is the raw JSON exchange under it, light enough for the
commands that must start fast. This package imports neither at its own import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xhpc.client.control import Client
    from xhpc.client.http import BrokerTransport

__all__ = ["BrokerTransport", "Client"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from xhpc.client.control import Client

        return Client
    if name == "BrokerTransport":
        from xhpc.client.http import BrokerTransport

        return BrokerTransport
    raise AttributeError(f"module 'xhpc.client' has no attribute {name!r}")
