"""What the `xhpc doctor --site` job runs on a compute node (``python -m xhpc.sitecheck.node``).

It connects to the broker's agent port (``--connect HOST:PORT``, one small HTTP request whose
answer's ``Date`` header gives the login node's clock), stats paths (``--stat PATH``: the state
directory), starts NVML as the probe does, and prints one line: ``REPORT_PREFIX`` and the
:class:`~xhpc.sitecheck.verdicts.NodeReport` as JSON. Every part is bounded and answers on its
own: a failing one is a field of the report, never a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

from xhpc.nvml import NvmlUnavailable, load_pynvml
from xhpc.sitecheck.verdicts import REPORT_PREFIX, ConnectSeen, NodeReport, NvmlSeen, PathSeen

CONNECT_TIMEOUT_S = 5.0
ANSWER_BYTES = 8192  # an answer's head is read up to this


def _date_header(head: bytes) -> float | None:
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == b"date":
            try:
                return parsedate_to_datetime(value.strip().decode("latin-1")).timestamp()
            except (TypeError, ValueError):
                return None
    return None


def connect(target: str) -> ConnectSeen:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return ConnectSeen(target=target, ok=False, error="not HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S) as conn:
            conn.settimeout(CONNECT_TIMEOUT_S)
            sent = time.time()
            conn.sendall(b"GET /xhpc-doctor HTTP/1.0\r\nHost: xhpc\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head and len(head) < ANSWER_BYTES:
                chunk = conn.recv(ANSWER_BYTES)
                if not chunk:
                    break
                head += chunk
            middle = (sent + time.time()) / 2
    except OSError as err:
        return ConnectSeen(target=target, ok=False, error=str(err) or type(err).__name__)
    server = _date_header(head)
    return ConnectSeen(
        target=target,
        ok=True,
        server_time_s=server,
        local_time_s=middle if server is not None else None,
    )


def stat_path(path: str) -> PathSeen:
    p = Path(path)
    try:
        exists, is_dir = p.exists(), p.is_dir()
    except OSError as err:
        return PathSeen(path=path, exists=False, error=str(err))
    return PathSeen(
        path=path,
        exists=exists,
        is_dir=is_dir,
        readable=os.access(p, os.R_OK | os.X_OK) if is_dir else os.access(p, os.R_OK),
        writable=os.access(p, os.W_OK),
    )


def nvml() -> NvmlSeen:
    try:
        lib = load_pynvml()
    except NvmlUnavailable as err:
        return NvmlSeen(ok=False, error=str(err))
    try:
        count = int(lib.nvmlDeviceGetCount())
        driver = lib.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception as err:  # NVML's error, or odd bindings: a field of the report
        return NvmlSeen(ok=False, error=f"{type(err).__name__}: {err}")
    finally:
        with contextlib.suppress(Exception):  # shutting down is best effort
            lib.nvmlShutdown()
    return NvmlSeen(ok=True, gpus=count, driver=driver)


def report(target: str | None, paths: list[str]) -> NodeReport:
    started = time.time()
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return NodeReport(
        node=node,
        time_s=started,
        connect=connect(target) if target else None,
        paths=tuple(stat_path(p) for p in paths),
        nvml=nvml(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xhpc.sitecheck.node")
    parser.add_argument("--connect", metavar="HOST:PORT")
    parser.add_argument("--stat", action="append", default=[], metavar="PATH")
    args = parser.parse_args(argv)
    sys.stdout.write(REPORT_PREFIX + report(args.connect, args.stat).model_dump_json() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
