"""xhpc: a Slurm-native serving plane for open LLMs.

The Python API (``xhpc.serve``, ``xhpc.connect``, ``xhpc.Deployment``, ``xhpc.local``:
xhpc/api.py) is loaded
on first use, so that importing the package (as the CLI does) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:
    from xhpc.api import Deployment, connect, local, serve

__all__ = ["Deployment", "__version__", "connect", "local", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("Deployment", "connect", "local", "serve"):
        from xhpc import api

        return getattr(api, name)
    raise AttributeError(f"module 'xhpc' has no attribute {name!r}")
