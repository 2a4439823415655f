"""The terminal for `xhpc top`: keys read without Enter (cbreak mode), the mode put back on
every way out (return, exception, Ctrl-C, SIGTERM)."""

from __future__ import annotations

import os
import select
import signal
import termios
import tty
from types import FrameType, TracebackType
from typing import Any


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through __exit__: the terminal is restored


class KeyReader:
    """Keys from the terminal at ``fd``; a context manager that restores its mode."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._saved: list[Any] | None = None
        self._sigterm: Any = None

    def __enter__(self) -> KeyReader:
        self._saved = termios.tcgetattr(self.fd)
        self._sigterm = signal.signal(signal.SIGTERM, _terminate)
        tty.setcbreak(self.fd)  # keeps ISIG: Ctrl-C still interrupts
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def read(self, timeout_s: float) -> str | None:
        """What was typed within ``timeout_s`` ("" if nothing); None: the terminal is gone."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout_s))
        if not ready:
            return ""
        try:
            data = os.read(self.fd, 64)
        except OSError:
            return None
        return data.decode(errors="replace") if data else None
