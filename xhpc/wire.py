"""What xhpc's own components say to each other across versions (pure): a rolling upgrade runs
a broker, gateways and agents of two versions together.

- **Each side names its wire version** in the ``X-Xhpc-Wire`` header of every call and answer
  of the control and agent APIs (a call without one is of version 1, the versions before the
  header). A broker serves callers from ``OLDEST_WIRE`` up; an older one gets a 426 that says
  what to upgrade. A newer caller is served: it knows what this broker understands.
- **A component reads another's message leniently** (``read``, ``read_json``): a field it does
  not know, which a newer version added, is ignored, at any depth. What a person typed (a
  serve request, a scaling change, a key, the config) stays strict: an unknown field there is a
  mistake, refused with its name.
- **A client sends a request without its defaults** (``request_json``): a newer client's
  request that uses nothing new is one an older broker understands; one that uses a new option
  is refused by that broker, naming it, instead of the option being dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # `xhpc ps` sends the header without loading pydantic
    from pydantic import BaseModel, TypeAdapter

WIRE_VERSION = 2  # 1: before the header; 2: the header, lenient reads, requests without defaults
OLDEST_WIRE = 1  # the oldest caller a broker of this version serves
WIRE_HEADER = "X-Xhpc-Wire"

M = TypeVar("M", bound="BaseModel")
T = TypeVar("T")


def read(model: type[M], data: Any) -> M:
    """``data`` (parsed JSON) another xhpc component sent, as ``model``; unknown fields ignored."""
    return model.model_validate(data, extra="ignore")


def read_json(model: type[M], raw: str | bytes) -> M:
    """The same as ``read``, from JSON text."""
    return model.model_validate_json(raw, extra="ignore")


def read_list(adapter: TypeAdapter[T], data: Any) -> T:
    """A list (or other shape) of models another component sent; unknown fields ignored."""
    return adapter.validate_python(data, extra="ignore")


def request_json(request: BaseModel) -> str:
    """``request`` as a client sends it: only what differs from the defaults."""
    return request.model_dump_json(exclude_defaults=True)


def peer_wire(value: str | None) -> int | None:
    """The wire version a ``X-Xhpc-Wire`` header names (absent: 1); None when it names none."""
    if value is None:
        return 1
    text = value.strip()
    if not text.isdigit() or len(text) > 6:
        return None
    return int(text)


def refusal(version: int | None) -> str | None:
    """Why a broker of this version does not serve a caller of ``version``; None: it does."""
    if version is None:
        return f"the {WIRE_HEADER} header must be a whole number"
    if version < OLDEST_WIRE:
        return (
            f"this broker serves xhpc components of wire version {OLDEST_WIRE} to "
            f"{WIRE_VERSION}; the caller speaks {version}: upgrade it"
        )
    return None
