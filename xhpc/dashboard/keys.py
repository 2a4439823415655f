"""`xhpc top`'s keys (pure): what a key pressed does to the screen.

``q`` quits; ``/`` or ``f`` starts typing a filter (a model name, or part of one), Enter keeps
it, Esc clears it, Backspace takes back a character. Ctrl-C quits too (the terminal's own
signal). An escape sequence (an arrow key) arrives as one chunk starting with Esc and is
ignored.
"""

from __future__ import annotations

from dataclasses import replace

from xhpc.dashboard.view import Screen

ESC = "\x1b"
MAX_FILTER = 64


def on_keys(screen: Screen, chunk: str) -> Screen | None:
    """The screen after the keys in ``chunk`` (one read of the terminal); None: quit."""
    if len(chunk) > 1 and chunk.startswith(ESC):
        return screen  # an arrow or function key
    for key in chunk:
        after = _on_key(screen, key)
        if after is None:
            return None
        screen = after
    return screen


def _on_key(screen: Screen, key: str) -> Screen | None:
    if screen.typing:
        if key in ("\r", "\n"):
            return replace(screen, typing=False)
        if key == ESC:
            return replace(screen, typing=False, filter="")
        if key in ("\x7f", "\b"):
            return replace(screen, filter=screen.filter[:-1])
        if key.isprintable() and len(screen.filter) < MAX_FILTER:
            return replace(screen, filter=screen.filter + key)
        return screen
    if key in ("q", "Q"):
        return None
    if key in ("/", "f"):
        return replace(screen, typing=True)
    if key == ESC:
        return replace(screen, filter="")
    return screen
