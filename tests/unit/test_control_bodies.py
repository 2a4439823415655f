"""The control API refuses a malformed body or a path it cannot resolve with a 4xx error object,
never a 500 (found by tests/test_properties_control.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.test_broker_service import make
from xhpc.broker.api import MAX_CONTROL_BODY, control_app
from xhpc.engine_config import ModelEngineConfig
from xhpc.models import EngineKind, NodeInfo, ServeRequest

pytestmark = [pytest.mark.security, pytest.mark.adversarial]


@pytest.fixture
async def client(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> AsyncIterator[TestClient]:  # type: ignore[type-arg]
    service, _ = make(tmp_path, idle_nodes)
    async with TestClient(TestServer(control_app(service))) as c:
        yield c


async def refused(
    client: TestClient,  # type: ignore[type-arg]
    path: str,
    body: bytes,
    status: int | None = 400,
    **headers: str,
) -> str:
    """The error message of the 4xx (``status``; None: any) that ``body`` is answered with."""
    headers = {"Content-Type": "application/json", **headers}
    resp = await client.post(path, data=body, headers=headers)
    data = await resp.json()
    assert resp.status == status if status is not None else 400 <= resp.status < 500, data
    assert set(data) == {"error"} and data["error"]["code"] and data["error"]["message"], data
    return str(data["error"]["message"])


async def test_stop_and_scale_refuse_a_body_that_is_not_their_object(client: TestClient) -> None:  # type: ignore[type-arg]
    """Failed before the fix: a JSON list or null was a 500 (``.get`` on it), so was a
    ``replicas`` that is not a number (``int("x")``), ``Infinity`` (``int(inf)``), and a deeply
    nested array (the JSON reader's RecursionError)."""
    for body in (b"[1]", b"null", b'"a"', b"[" * 50_000):
        await refused(client, "/v1/stop", body)
        await refused(client, "/v1/scale", body)
    for replicas in (b'"x"', b"1.5", b"Infinity", b"[2]", b"null"):
        await refused(client, "/v1/scale", b'{"name": "m", "replicas": ' + replicas + b"}")
    assert "target" in await refused(client, "/v1/stop", b'{"target": 5}')
    await refused(client, "/v1/stop", b'{"target": "nothing"}', status=404)


async def test_a_body_that_is_not_utf8_or_names_an_unknown_charset_is_a_400(
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    """Failed before the fix: the body was decoded as text first (strictly, in the charset the
    client named): bytes that are not UTF-8, or ``charset=bogus``, were a 500. A JSON body is
    UTF-8 whatever the charset says."""
    bogus = {"Content-Type": "application/json; charset=bogus"}
    for path in ("/v1/serve", "/v1/stop", "/v1/keys", "/v1/orphans/fix", "/v1/cache/pull"):
        await refused(client, path, b'{"model": "\xff\xfe"}')
        await refused(client, path, b'{"model": "~nosuchuser/m", "target": "x"}', None, **bogus)


async def test_a_model_path_that_cannot_be_resolved_is_no_model(
    client: TestClient,  # type: ignore[type-arg]
    tmp_path: Path,
) -> None:
    """Failed before the fix: ``~nosuchuser/m`` (no home directory), a symlink loop and a name
    too long for the filesystem were a 500 from serve's and a batch's model."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    loop = str(tmp_path / "loop" / "m")
    for model in ("~nosuchuser/m", "~0", loop, "/" + "a" * 5000, "./" + "a/" * 3000):
        body = f'{{"model": "{model}"}}'.encode()
        message = await refused(client, "/v1/serve?dry_run=1", body, status=404)
        assert "cannot be resolved" in message and len(message) < 200, message


async def test_a_time_limit_in_other_digits_is_refused_before_a_script_is_made(
    client: TestClient,  # type: ignore[type-arg]
    model_dir: Path,
) -> None:
    """Failed before the fix: the time rule's ``\\d`` took any script's digits, so a thousand
    in Arabic-Indic digits passed the request's check and the renderer refused it: a 500 from
    serve."""
    for time in ("\u0661\u0660\u0660\u0660", "\uff11\uff10:00"):
        body = f'{{"model": "{model_dir}", "time": "{time}"}}'.encode()
        assert "time" in await refused(client, "/v1/serve?dry_run=1", body)


async def test_a_body_over_the_control_limit_is_a_413_error_object(client: TestClient) -> None:  # type: ignore[type-arg]
    """Failed before the fix: aiohttp's own 413 passed through as plain text, the one 4xx of
    the control API without the JSON error object."""
    message = await refused(client, "/v1/serve", b"x" * (MAX_CONTROL_BODY + 1), status=413)
    assert str(MAX_CONTROL_BODY) in message


async def test_serve_across_nodes_refuses_hostile_sizes_and_a_site_that_has_not_allowed_it(
    client: TestClient,  # type: ignore[type-arg]
    model_dir: Path,
) -> None:
    """``nodes`` that is not a whole number in 1..64 is a 4xx, never a 500; a well-formed
    ``nodes`` > 1 is refused by admission while ``[multi_node] enabled`` is off (the default)."""
    for nodes in (b'"2; rm -rf /"', b"0", b"-1", b"65", b"1.5", b"Infinity", b"[2]", b"1e9"):
        body = b'{"model": "' + str(model_dir).encode() + b'", "engine": "vllm", "nodes": ' + nodes
        await refused(client, "/v1/serve?dry_run=1", body + b"}", status=None)
    body = f'{{"model": "{model_dir}", "engine": "vllm", "nodes": 2}}'.encode()
    message = await refused(client, "/v1/serve", body, status=None)
    assert "[multi_node] enabled = false" in message, message
    # The same for a PD unit's per-side nodes.
    for field in (b"prefill_nodes", b"decode_nodes"):
        for nodes in (b'"2; id"', b"0", b"65", b"1.5", b"[2]"):
            body = b'{"model": "' + str(model_dir).encode() + b'", "engine": "vllm", "pd": '
            body += b'"1P1D", "' + field + b'": ' + nodes + b"}"
            await refused(client, "/v1/serve?dry_run=1", body, status=None)
    body = f'{{"model": "{model_dir}", "engine": "vllm", "pd": "1P1D", "prefill_nodes": 2}}'
    message = await refused(client, "/v1/serve", body.encode(), status=None)
    assert "--prefill-nodes 2: instances across nodes are off" in message, message


async def test_serve_refuses_a_hostile_engine_config_as_a_4xx(
    client: TestClient,  # type: ignore[type-arg]
    model_dir: Path,
) -> None:
    """A model's engine configuration sent through the control API: hostile names, paths out of
    the weights, deep or odd JSON and unknown keys are a 4xx naming the field, never a 500."""
    hostile = (
        '{"tool_call_parser": "hermes; id"}',
        '{"chat_template": "/srv/xhpc/control.token"}',
        '{"chat_template": "../../etc/passwd"}',
        '{"generation_config": "/srv"}',
        '{"speculative_config": {"model": "/srv/xhpc"}}',
        '{"speculative_config": "{\\"method\\": \\"ngram\\"}"}',
        '{"limit_mm_per_prompt": {"image": -1}}',
        '{"max_model_len": 1e99}',
        '{"enable_lora": true}',
        "[]",
    )
    for cfg in hostile:
        body = f'{{"model": "{model_dir}", "engine": "vllm", "engine_config": {cfg}}}'
        message = await refused(client, "/v1/serve?dry_run=1", body.encode(), status=None)
        assert "engine_config" in message, (cfg, message)
    wrong = f'{{"model": "{model_dir}", "engine": "transformers", "engine_config": {{}}}}'
    message = await refused(client, "/v1/serve?dry_run=1", wrong.encode(), status=None)
    assert "engine_config applies to the vllm engine" in message, message


async def test_adapters_add_refuses_hostile_bodies_as_a_4xx_and_records_nothing(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    """`POST /v1/adapters` with hostile names, paths and shapes, on a deployment with room for
    adapters: a 4xx error object naming what is wrong, never a 500, and no adapter recorded."""
    service, _ = make(tmp_path, idle_nodes)
    lora = ModelEngineConfig(lora={"max_lora_rank": 8})
    await service.serve(ServeRequest(model=str(model_dir), name="base", engine=EngineKind.VLLM,
                                     engine_config=lora), None)  # fmt: skip
    good = tmp_path / "ad"
    good.mkdir()
    (good / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, '
                                              '"target_modules": ["q_proj"]}')  # fmt: skip
    (good / "adapter_model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "link").symlink_to(good)
    (tmp_path / "file").write_text("x")
    ok = {"name": "a1", "base": "base", "path": str(good)}
    hostile: list[tuple[object, str]] = [
        ({**ok, "name": "../x"}, "name"),
        ({**ok, "name": "a b"}, "name"),
        ({**ok, "name": "a" * 65}, "name"),
        ({**ok, "name": "a\x00"}, "name"),
        ({**ok, "name": "base"}, "a deployment is named"),
        ({**ok, "path": "rel/dir"}, "absolute"),
        ({**ok, "path": f"{tmp_path}/\x00x"}, "path"),
        ({**ok, "path": str(tmp_path / "link")}, "link"),
        ({**ok, "path": str(tmp_path / "file")}, "director"),
        ({**ok, "path": str(tmp_path / "none")}, ""),
        ({**ok, "path": "/" + "p" * 5000}, "path"),
        ({**ok, "owner": "root"}, "owner"),
        ({**ok, "base": ["base"]}, "base"),
        (["a1"], ""),
    ]
    async with TestClient(TestServer(control_app(service))) as client:
        for body, why in hostile:
            sent = json.dumps(body).encode()
            message = await refused(client, "/v1/adapters", sent, status=None)
            assert why.lower() in message.lower(), (sent[:80], message)
        await refused(client, "/v1/adapters", b'{"name": "a1", "base": "nope", "path": "/x"}',
                      status=404)  # fmt: skip
        for bad in ("a%00b", "..%2F..", "a%20b", "x" * 100):
            await refused(client, f"/v1/adapters/{bad}/rm", b"{}")
    assert service.adapter_desk.adapters.all() == []
