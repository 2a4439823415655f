"""A replica's logs as the control API shows them: the end of its job output and engine log,
each read with one bounded read however large it grew."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from xhpc.models import LogsView

LOG_TAIL_BYTES = 1024 * 1024  # of each log, only this much of its end is ever read


def tail(path: Path, lines: int, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``lines`` lines found in the last ``max_bytes`` bytes of ``path``: a log of
    any size costs one bounded read. A path that is not a regular file (a FIFO would block)
    or cannot be read gives ""."""
    if lines <= 0:
        return ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        start = max(0, st.st_size - max_bytes)
        data = os.pread(fd, max_bytes, start)
    except OSError:
        return ""
    finally:
        os.close(fd)
    kept = data.decode(errors="replace").splitlines()
    if start > 0 and len(kept) > 1:
        kept = kept[1:]  # cut by the bound: not a whole line
    return "\n".join(kept[-lines:])


def logs_view(replica_id: str, out: Path | None, engine_log: Path | None, lines: int) -> LogsView:
    return LogsView(
        replica_id=replica_id,
        job_output=tail(out, lines) if out else "",
        engine_log=tail(engine_log, lines) if engine_log else "",
    )
