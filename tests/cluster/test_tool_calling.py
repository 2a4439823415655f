"""Tool calling through the gateway with the unmodified openai SDK, on two deployments of the
tiny model at once whose engine configurations name different tool-call parsers (one from the
site catalog, one from a member's), on the dev cluster with real vLLM on CPU.

What a member relies on: a named tool choice comes back as a call of that tool, a required one
as calls of offered tools (the engine's own); an auto tool
choice runs the deployment's parser; the catalog's chat template is the
one the engine renders; a parser the installed vLLM does not have is refused at admission,
before anything is submitted. The tiny model's text is random: no answer's wording is asserted.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster.test_chaos import ready
from tests.conftest import Xhpc, own_xhpc, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                # Enums keep a random model's arguments short: guided decoding keeps them valid.
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Rome"]},
                    "days": {"type": "integer", "enum": [1, 2, 3]},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
# The tiny model's own template, with the offered tools' names before the conversation.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}\n{% endif %}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


GUIDED = '{ backend = "xgrammar", disable_any_whitespace = true }'


def _entry(name: str, weights: Path, *config: str) -> str:
    """A catalog entry for the tiny model's copy, with these `engine_config` lines."""
    lines = "\n".join(config)
    return f"""
[models.{name}]
path = "{weights}"
engine = "vllm"

[models.{name}.engine_config]
{lines}
"""


def _config(weights: Path) -> str:
    """The site catalog (the test's config file): hermes, and a parser vLLM does not have."""
    hermes = _entry(
        "tools-hermes", weights, 'tool_call_parser = "hermes"', "enable_auto_tool_choice = true",
        'chat_template = "tool_chat_template.jinja"', f"structured_outputs = {GUIDED}",
        "max_model_len = 1024",
    )  # fmt: skip
    return hermes + _entry("tools-nosuch", weights, 'tool_call_parser = "nosuch"')


def _member_catalog(weights: Path) -> str:
    return _entry(
        "tools-llama", weights, 'tool_call_parser = "pythonic"',
        "enable_auto_tool_choice = true", f"structured_outputs = {GUIDED}",
    )  # fmt: skip


def _client(x: Xhpc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, name: str, choice: Any, max_tokens: int) -> Any:
    """The chat answer to ASK with the offered TOOLS and this tool choice, greedy."""
    return client.chat.completions.create(
        model=name,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=max_tokens,
        temperature=0,
    )


def _check_named_call(client: openai.OpenAI, name: str) -> None:
    """A named tool choice comes back as a call of that tool, its arguments JSON."""
    named = _ask(client, name, {"type": "function", "function": {"name": "get_weather"}}, 120)
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    json.loads(call.function.arguments)


def _required(client: openai.OpenAI, name: str) -> list[tuple[str, str]]:
    """A required tool choice's calls, as (tool, arguments)."""
    calls = _ask(client, name, "required", 200).choices[0].message.tool_calls or []
    return [(c.function.name, c.function.arguments) for c in calls]  # type: ignore[union-attr]


def _check_required_call(client: openai.OpenAI, direct: openai.OpenAI, name: str) -> None:
    """A required tool choice comes back as calls of offered tools with JSON arguments, the
    engine's own calls for the same request. (vLLM 0.32's hermes and pythonic paths give the
    tiny model's calls `null` arguments, though the same schema through `structured_outputs`
    yields valid ones: what the engine answers is what the client gets.)"""
    calls = _required(client, name)
    assert calls and all(tool in {t["function"]["name"] for t in TOOLS} for tool, _ in calls)
    for _, arguments in calls:
        json.loads(arguments)
    assert calls == _required(direct, name)


def _direct(x: Xhpc, name: str) -> openai.OpenAI:
    """The deployment's engine itself, with its secret (the test is the replica's owner)."""
    (row,) = ready(x, name)
    secret = (x.state_dir / "replicas" / row["replica_id"] / "engine_secret").read_text().strip()
    return openai.OpenAI(
        base_url=f"http://{row['host']}:{row['port']}/v1", api_key=secret, max_retries=0
    )


def _prompt_tokens(row: dict[str, Any], secret: str, tools: bool) -> int:
    body: dict[str, Any] = {"model": row["deployment"], "messages": ASK}
    if tools:
        body["tools"] = TOOLS
    req = urllib.request.Request(
        f"http://{row['host']}:{row['port']}/tokenize",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {secret}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(json.loads(resp.read())["count"])


def test_two_deployments_with_different_tool_parsers_serve_tools_at_once(
    dev_cluster: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    weights = tmp_path_factory.mktemp("tools") / "tiny-tools"
    shutil.copytree(tiny_model, weights)
    (weights / "tool_chat_template.jinja").write_text(TOOL_TEMPLATE)
    with own_xhpc(tiny_model, _config(weights)) as x:
        catalog = x.state_dir / "models.toml"  # the member's own, next to their config
        catalog.write_text(_member_catalog(weights))
        catalog.chmod(0o600)
        # A parser the installed vLLM has not registered: refused at admission, from its schema.
        bad = x.run("serve", "tools-nosuch", "--detach", check=False)
        assert bad.returncode == 2, bad.stdout + bad.stderr
        assert "--tool-call-parser nosuch" in bad.stderr and "hermes" in bad.stderr
        assert x.my_jobs() == []
        x.run("serve", "tools-hermes", "--detach", "--timeout", "480")
        x.run("serve", "tools-llama", "--timeout", "480")
        wait_for(lambda: len(ready(x, "tools-hermes")) == 1, 480, "the hermes deployment READY")
        client = _client(x)
        for name in ("tools-hermes", "tools-llama"):
            _check_named_call(client, name)
            _check_required_call(client, _direct(x, name), name)
            # auto: the deployment's own parser reads the (random) answer; a 200 either way
            auto = _ask(client, name, "auto", 12)
            assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls"), auto
        # Each engine got its own parser, and only the hermes one the catalog's template.
        for name, parser in (("tools-hermes", "hermes"), ("tools-llama", "pythonic")):
            (row,) = ready(x, name)
            rdir = x.state_dir / "replicas" / row["replica_id"]
            args = json.loads((rdir / "spec.json").read_text())["args"]
            assert args[args.index("--tool-call-parser") + 1] == parser, args
            secret = (rdir / "engine_secret").read_text().strip()
            grows = _prompt_tokens(row, secret, True) > _prompt_tokens(row, secret, False)
            assert grows is (name == "tools-hermes"), name
        x.run("stop", "tools-hermes")
        x.run("stop", "tools-llama")
        x.wait_no_jobs(180)
