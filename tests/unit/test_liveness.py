"""The agent's liveness port and the gateway's question to it: a greeting means the job lives;
refused, silent or a stranger's answer means it is gone; one question per replica at a time."""

from __future__ import annotations

import asyncio
import socket

from xhpc.agent.liveness import LivenessPort
from xhpc.models import Route
from xhpc.proxy.engines.liveness import JobLiveness


def route(port: int | None, rid: str = "r1") -> Route:
    return Route(
        model="m", replica_id=rid, url="http://127.0.0.1:9", served_model="m", agent_port=port
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_live_agent_means_the_job_lives_and_a_closed_port_that_it_is_gone() -> None:
    agent = LivenessPort()
    port = await agent.start("127.0.0.1")
    try:
        assert not await JobLiveness().gone(route(port))
    finally:
        await agent.stop()
    # The same port once the agent is gone: refused.
    assert await JobLiveness().gone(route(port))
    assert await JobLiveness().gone(route(closed_port()))


async def test_no_port_is_never_gone_and_silence_or_a_stranger_is_gone() -> None:
    assert not await JobLiveness().gone(route(None))

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # holds the connection, says nothing

    async def stranger(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
        writer.close()

    for handler in (silent, stranger):
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            assert await JobLiveness(timeout_s=0.3).gone(route(port))
        finally:
            server.close()


async def test_concurrent_questions_share_one_connection_and_the_answer_is_kept() -> None:
    greeted = 0
    agent = LivenessPort()
    inner = agent._greet

    async def counting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal greeted
        greeted += 1
        await inner(reader, writer)

    agent._greet = counting  # type: ignore[method-assign, assignment]
    port = await agent.start("127.0.0.1")
    now = [0.0]
    live = JobLiveness(memo_s=2.0, clock=lambda: now[0])
    try:
        answers = await asyncio.gather(*(live.gone(route(port)) for _ in range(10)))
        assert answers == [False] * 10 and greeted == 1
        assert not await live.gone(route(port)) and greeted == 1  # kept
        now[0] = 5.0
        assert not await live.gone(route(port)) and greeted == 2  # asked again
    finally:
        await agent.stop()


async def test_a_caller_that_leaves_does_not_end_the_question_for_the_others() -> None:
    async def slow(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.2)
        writer.write(b"xhpc-agent alive\n")
        writer.close()

    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    live = JobLiveness()
    try:
        first = asyncio.ensure_future(live.gone(route(port)))
        second = asyncio.ensure_future(live.gone(route(port)))
        await asyncio.sleep(0.05)
        first.cancel()
        assert await second is False
    finally:
        server.close()
