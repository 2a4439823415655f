"""The identifiers clients name (foundation): one rule per kind, checked where the id enters,
and the broker's control paths built from checked parts only.

An id from a client (a URL's path, a JSON body) is checked against its kind's rule before it
is used for anything: a malformed one is a "no such thing", never part of a path, a file name
or a query. Paths to the broker's control API are built by ``control_path`` from constant
words and checked ids, each percent-encoded as one segment, with the query encoded apart:
never by pasting strings.

- batch ``batch_`` + 24 hex; a batch's input upload ``input_`` + 24 hex;
- file ``file-`` + 24 hex; a batch's results ``file-out-BATCH`` and ``file-err-BATCH``;
- key ``xhpc-KEYID.SECRET``'s KEYID: 12 hex (``xhpc.access.KEY_RE``);
- pull 8 hex (``xhpc cache pull``);
- deployment, replica and user names: ``xhpc.models.NAME_RE`` (``check_name``).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import quote, urlencode

from xhpc.models import NAME_RE


class IdKind(StrEnum):
    BATCH = "batch id"
    BATCH_INPUT = "batch input id"
    FILE = "file id"
    RESULT_FILE = "result file id"
    KEY = "key id"
    PULL = "pull id"
    NAME = "name"  # deployment, replica, user


BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{24}$")
RESULT_FILE_RE = re.compile(r"^file-(out|err)-(batch_[0-9a-f]{24})$")
_RULES: dict[IdKind, re.Pattern[str]] = {
    IdKind.BATCH: BATCH_ID_RE,
    IdKind.BATCH_INPUT: re.compile(r"^input_[0-9a-f]{24}$"),
    IdKind.FILE: re.compile(r"^file-[0-9a-f]{24}$"),
    IdKind.RESULT_FILE: RESULT_FILE_RE,
    IdKind.KEY: re.compile(r"^[0-9a-f]{12}$"),
    IdKind.PULL: re.compile(r"^[0-9a-f]{8}$"),
    IdKind.NAME: NAME_RE,
}
_WORD = re.compile(r"^[a-z0-9][a-z0-9-]*$")  # a constant segment of a control path


def valid(kind: IdKind, value: object) -> bool:
    """Whether ``value`` is a string that passes ``kind``'s rule."""
    return isinstance(value, str) and _RULES[kind].fullmatch(value) is not None


def check(kind: IdKind, value: str) -> str:
    """``value`` when it passes ``kind``'s rule; ValueError (naming the kind) when not."""
    if not valid(kind, value):
        text = str(value)
        shown = text if text.isprintable() and len(text) <= 80 else repr(text[:80])
        raise ValueError(f"invalid {kind.value} {shown}")
    return value


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def new_input_id() -> str:
    return f"input_{secrets.token_hex(12)}"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Id:
    """One id of a control path: checked against its kind's rule when it is built."""

    kind: IdKind
    value: str

    def __post_init__(self) -> None:
        check(self.kind, self.value)


def control_path(*segments: str | Id, query: Mapping[str, str | int] | None = None) -> str:
    """``/seg/seg...?query`` for the broker's control API: each ``str`` segment is a constant
    word of the API (lower-case letters, digits, '-'), each ``Id`` a checked id; every segment
    is percent-encoded as one path segment and the query is encoded apart. ValueError for any
    other segment (a slash, a dot segment, a '?', a blank)."""
    parts = []
    for seg in segments:
        if isinstance(seg, Id):
            parts.append(quote(seg.value, safe=""))
        elif _WORD.fullmatch(seg):
            parts.append(seg)
        else:
            raise ValueError(f"not a control path segment: {seg!r}")
    path = "/" + "/".join(parts)
    if query:
        path += "?" + urlencode({k: str(v) for k, v in query.items()})
    return path
