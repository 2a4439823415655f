"""Settings of the per-node probe: the `[probe]` section of the config (xhpc.settings)."""

from xhpc.settings import BackendKind, ProbeSettings

__all__ = ["BackendKind", "ProbeSettings"]
