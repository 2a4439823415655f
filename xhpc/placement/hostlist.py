"""Slurm hostlist expressions -> node names (pure).

Slurm prints node sets compressed: ``n[1-3,5]``, ``gpu[01-10]``, ``n1,login``, ``rack[1-2]-n[1-2]``.
Commas outside brackets separate items; inside one item each bracket group holds comma-separated
numbers or ``lo-hi`` ranges, and a range keeps the zero padding of its lower bound (``[08-10]`` ->
``08 09 10``). Several bracket groups in one item expand as their cartesian product, in Slurm's
order (the leftmost group varies slowest).
"""

from __future__ import annotations

import re

from xhpc.errors import SlurmParseError

MAX_HOSTS = 1_000_000
_NULL = {"", "(null)", "none", "n/a", "none assigned"}
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_items(text: str) -> list[str]:
    """Split on commas that are outside brackets; reject unbalanced brackets."""
    items: list[str] = []
    depth = 0
    start = 0
    for pos, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmParseError(f"hostlist {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmParseError(f"hostlist {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:pos])
            start = pos + 1
    if depth:
        raise SlurmParseError(f"hostlist {text!r}: '[' without ']'")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_group(body: str, text: str) -> list[str]:
    """ "1-3,5" -> ["1", "2", "3", "5"]; "08-10" -> ["08", "09", "10"]."""
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise SlurmParseError(f"hostlist {text!r}: cannot read range {part!r}")
        lo_text, hi_text = m.group(1), m.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise SlurmParseError(f"hostlist {text!r}: range {part!r} runs backwards")
        if hi - lo + 1 > MAX_HOSTS:
            raise SlurmParseError(f"hostlist {text!r}: range {part!r} is too large")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_item(item: str, text: str) -> list[str]:
    """One comma item with zero or more bracket groups -> names."""
    names = [""]
    rest = item
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            names = [n + rest for n in names]
            break
        close_at = rest.index("]", open_at)  # balanced: checked by _split_items
        prefix, body = rest[:open_at], rest[open_at + 1 : close_at]
        values = _expand_group(body, text)
        if len(names) * len(values) > MAX_HOSTS:
            raise SlurmParseError(f"hostlist {text!r} names more than {MAX_HOSTS} hosts")
        names = [n + prefix + v for n in names for v in values]
        rest = rest[close_at + 1 :]
    return names


def expand_hostlist(text: str | None) -> tuple[str, ...]:
    """A Slurm hostlist expression -> the node names it stands for, in order, without duplicates.

    ``None``, ``""`` and ``"(null)"`` stand for no nodes. Malformed expressions raise
    :class:`~xhpc.errors.SlurmParseError`.
    """
    if text is None or text.strip().lower() in _NULL:
        return ()
    if "[" not in text and "]" not in text and "," not in text:  # one plain name: most jobs
        return (text.strip(),)
    seen: dict[str, None] = {}
    for item in _split_items(text.strip()):
        for name in _expand_item(item, text):
            seen.setdefault(name, None)
        if len(seen) > MAX_HOSTS:
            raise SlurmParseError(f"hostlist {text!r} names more than {MAX_HOSTS} hosts")
    return tuple(seen)
