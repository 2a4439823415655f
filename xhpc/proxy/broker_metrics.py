"""The brokers' part of the gateway's ``/metrics`` (decision 0036): each broker's ``GET
/v1/metrics`` (its own ``xhpc_broker_*`` series and its engines' series), fetched by the worker
that answers the scrape, when it answers it.

Each broker is asked through ``xhpc.proxy.broker_call`` (its own connection, bounded answer,
the peer uid of that connection), all at once, each within ``TIMEOUT_S``. A broker's text is
not passed through: it is read by ``xhpc.prometheus``'s rules and written again, so that a
broker (a lab's member brokers are not trusted, decision 0014) cannot break the exposition nor
write the gateway's own families (``xhpc_proxy_*``, ``xhpc_broker_up``).

``xhpc_broker_up`` says which brokers answered (1) and which did not (0: unreachable, too slow,
an error status, an answer over ``MAX_BYTES``); the gateway's own metrics are served either
way. A lab gateway (several brokers) labels each broker's series ``member``: the Unix user
that runs it, from the peer credentials of the connection its answer came on (a user whose
broker comes twice: ``user (socket path)``); its ``xhpc_broker_up`` carries ``broker`` (the
socket path) and that ``member`` ("" when it did not answer). Families several brokers export
are written once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from xhpc.errors import BrokerError, BrokerUnavailableError
from xhpc.peers import user_name
from xhpc.prometheus import LabelPairs, Labels, Merge, gauge, parse
from xhpc.proxy import broker_call

logger = logging.getLogger(__name__)

METRICS_PATH = "/v1/metrics"
TIMEOUT_S = 3.0  # a scrape waits this long for the brokers at most
MAX_BYTES = 32 * 1024 * 1024  # of one broker's answer
UP = "xhpc_broker_up"


@dataclass(frozen=True)
class Answer:
    path: Path
    text: str | None  # None: no usable answer
    uid: int | None


def _reserved(name: str) -> bool:
    return name == UP or name.startswith("xhpc_proxy_")


class BrokerSections:
    """Where the gateway's brokers listen; ``render`` is their part of one scrape."""

    def __init__(
        self, paths: Sequence[Path], *, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES
    ) -> None:
        if not paths:
            raise ValueError("no broker to read metrics from")
        self.paths = tuple(paths)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._down: set[Path] = set()  # brokers whose last scrape failed (logged once)

    async def render(self) -> str:
        answers = await asyncio.gather(*(self._ask(p) for p in self.paths))
        # Reading and writing a large text again: off the event loop, which serves requests.
        return await asyncio.to_thread(self.text, answers)

    async def _ask(self, path: Path) -> Answer:
        why = None
        try:
            got = await broker_call.call(
                path, "GET", METRICS_PATH, timeout_s=self.timeout_s, max_bytes=self.max_bytes
            )
        except (BrokerUnavailableError, BrokerError) as err:
            why = err.one_line()
        else:
            if got.status == 200:
                self._heard(path, None)
                return Answer(path, got.body.decode(errors="replace"), got.uid)
            why = f"it answered {got.status} to GET {METRICS_PATH}"
        self._heard(path, why)
        return Answer(path, None, None)

    def _heard(self, path: Path, why: str | None) -> None:
        if why is None:
            if path in self._down:
                logger.info("the broker at %s answers /metrics again", path)
            self._down.discard(path)
        elif path not in self._down:
            self._down.add(path)
            logger.warning("/metrics without the broker at %s: %s", path, why)

    def text(self, answers: Sequence[Answer]) -> str:
        """The brokers' part of the exposition, from their answers (pure)."""
        lab = len(self.paths) > 1
        merge = Merge(reserved=_reserved)
        up: list[tuple[Labels, float]] = []
        members: set[str] = set()
        for answer in answers:
            member = ""
            if answer.text is not None:
                member = str(answer.path) if answer.uid is None else user_name(answer.uid)
                if member in members:
                    member = f"{member} ({answer.path})"
                members.add(member)
                own: LabelPairs = (("member", member),) if lab else ()
                merge.add(parse(answer.text).families.values(), own)
            labels = (str(answer.path), member) if lab else ()
            up.append((labels, 0.0 if answer.text is None else 1.0))
        lines = gauge(
            UP,
            "Whether each broker answered the gateway's GET /v1/metrics at this scrape.",
            ("broker", "member") if lab else (),
            up,
        )
        return "\n".join([*lines, *merge.lines()]) + "\n"
