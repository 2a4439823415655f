"""A member's own catalog entry on the real cluster: added with `xhpc models add`, served under
its name (the broker gets the resolved request, never the member's file), answered through the
proxy, then removed."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.cluster.test_pilot import xhpc_echo  # noqa: F401  (the fixture)
from tests.conftest import Xhpc

pytestmark = [pytest.mark.cluster]


def test_a_members_own_entry_is_served_answered_and_removed(
    xhpc_echo: Xhpc,  # noqa: F811
    tiny_model: Path,
    unique_name: str,
) -> None:
    x, entry, name = xhpc_echo, f"{unique_name}-mine", unique_name
    x.run("models", "add", entry, "--path", str(tiny_model), "--engine", "command", "--gpus", "1")
    catalog = x.state_dir / "models.toml"  # next to this member's XHPC_USER_CONFIG
    assert catalog.stat().st_mode & 0o077 == 0
    rows = {r["name"]: r for r in json.loads(x.run("models", "list", "--json").stdout)}
    assert rows[entry]["source"] == "user"

    x.run("serve", entry, "--name", name, "--timeout", "90")
    (replica,) = [r for r in json.loads(x.run("ps", "--json").stdout) if r["deployment"] == name]
    assert replica["state"] == "READY" and replica["gpus"] and len(replica["gpus"]) == 1
    client = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content

    x.run("stop", name)
    x.run("models", "rm", entry)
    assert entry not in {r["name"] for r in json.loads(x.run("models", "list", "--json").stdout)}
    refused = x.run("serve", entry, "--name", f"{name}b", check=False)
    assert refused.returncode != 0 and not x.my_jobs()
