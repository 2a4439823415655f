"""`xhpc ps` against a fake broker on the control socket: the table, the notes under it, the
pilots' table and `--json` print what the broker's answers say, exactly as they did when the CLI
validated them into pydantic models; and `ps` imports none of the heavy packages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from tests.unit.conftest import Run
from tests.unit.test_cli_client import serving
from xhpc.models import (
    DeploymentView,
    EngineKind,
    PdRole,
    PilotState,
    PilotView,
    ReplicaOutlook,
    ReplicaState,
    ReplicaView,
    RestartPolicy,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def replica(rid: str, state: ReplicaState, **fields: Any) -> ReplicaView:
    dep = fields.pop("deployment", rid.rsplit("-", 1)[0])
    return ReplicaView(
        replica_id=rid,
        deployment=dep,
        index=int(rid.rsplit("-", 1)[1]),
        state=state,
        engine=fields.pop("engine", EngineKind.VLLM),
        created_at=T0,
        updated_at=T0,
        **fields,
    )


READY = replica(
    "tiny-llama-0", ReplicaState.READY, job_id="101", node="gpu-1", host="10.0.0.5",
    port=41000, gpus=(0, 1), ready_at=T0, last_heartbeat=T0, replica_dir="/secret/dir",
    outlook=ReplicaOutlook(replica_id="tiny-llama-0", time_left_s=2700.0),
)  # fmt: skip
QUEUED = replica(
    "tiny-llama-1", ReplicaState.QUEUED, job_id="102",
    reason="Resources: waiting for a node with 2 free GPUs " + "x" * 150,
    outlook=ReplicaOutlook(replica_id="tiny-llama-1", pending_reason="Resources"),
)  # fmt: skip
CREATING = replica("other-0", ReplicaState.CREATING, engine=EngineKind.TRANSFORMERS)
PREFILL = replica(
    "pd-m-0", ReplicaState.STARTING, role=PdRole.PREFILL, unit="pd-m-u0", job_id="103+0",
    node="gpu-2", gpus=(3,),
)  # fmt: skip
FAILED = replica("gone-0", ReplicaState.FAILED, job_id="99", reason="engine exited 1")
LIVE = [READY, QUEUED, CREATING, PREFILL]
EVERY = [*LIVE, FAILED]

DEPLOYMENTS = [
    DeploymentView(
        name="tiny-llama", model="tiny-llama", model_path="/m/tiny", engine=EngineKind.VLLM,
        gpus=2, replicas=(READY, QUEUED), wanted=3, restart=RestartPolicy.ON_FAILURE,
    ),
    DeploymentView(
        name="other", model="other", model_path="/m/o", engine=EngineKind.TRANSFORMERS, gpus=1,
        replicas=(CREATING,), wanted=1, failed_reason="crash loop: 3 failed starts in 600 s",
    ),
    DeploymentView(
        name="pd-m", model="pd-m", model_path="/m/pd", engine=EngineKind.VLLM, gpus=1,
        replicas=(PREFILL,), wanted=1,
    ),
    DeploymentView(
        name="gone", model="gone", model_path="/m/g", engine=EngineKind.VLLM, gpus=1,
        replicas=(FAILED,), wanted=1, stopped=True,
    ),
]  # fmt: skip
PILOTS = [
    PilotView(pilot_id="p-gpu-1", node="gpu-1", gpus=4, state=PilotState.RUNNING, job_id="200",
              devices=(0, 1, 2, 3), replicas=("tiny-llama-0", "other-0")),
    PilotView(pilot_id="p-gpu-2", node="gpu-2", gpus=2, state=PilotState.PENDING),
]  # fmt: skip


def wire(items: list[Any]) -> bytes:
    """What the broker sends (xhpc/broker/api.py dumps its views with pydantic)."""
    return TypeAdapter(list[type(items[0])]).dump_json(items)  # type: ignore[misc]


ANSWERS = {
    "/v1/replicas?all=0": (200, wire(LIVE)),
    "/v1/replicas?all=1": (200, wire(EVERY)),
    "/v1/deployments": (200, wire(DEPLOYMENTS)),
    "/v1/pilots": (200, wire(PILOTS)),
}


@pytest.fixture
def broker(clean_env: Path) -> Iterator[Path]:
    """A fake broker serving ANSWERS on the control socket of ``clean_env``."""
    with serving(clean_env, ANSWERS):
        yield clean_env


def shown(out: str) -> str:
    """The output, each line without its trailing blanks (a centred title pads its line)."""
    return "".join(line.rstrip() + "\n" for line in out.splitlines())


def test_ps_prints_the_table_and_notes(xhpc: Run, broker: Path) -> None:
    result = xhpc("ps")
    assert result.code == 0, result.err
    assert shown(result.out) == PS_TABLE


def test_ps_all(xhpc: Run, broker: Path) -> None:
    result = xhpc("ps", "--all")
    assert result.code == 0, result.err
    assert shown(result.out) == PS_ALL_TABLE


def test_ps_pilots(xhpc: Run, broker: Path) -> None:
    result = xhpc("ps", "--pilots")
    assert result.code == 0, result.err
    assert shown(result.out) == PILOTS_TABLE


@pytest.mark.parametrize(
    ("args", "items"), [(["--all"], EVERY), ([], LIVE), (["--pilots"], PILOTS)]
)  # fmt: skip
def test_ps_json_is_the_views_dumped(xhpc: Run, broker: Path, args: list[str], items: Any) -> None:
    result = xhpc("ps", "--json", *args)
    assert result.code == 0, result.err
    assert result.out == json.dumps([v.model_dump(mode="json") for v in items], indent=2) + "\n"


PS_TABLE = """\
┏━━━━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━┳━━━━━━━┳━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ replica      ┃ deployment ┃ role               ┃ state    ┃ engine       ┃ job   ┃ node  ┃ gpus ┃ endpoint              ┃ next                    ┃ detail                                           ┃
┡━━━━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━━╇━━━━━━━╇━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│ tiny-llama-0 │ tiny-llama │ -                  │ READY    │ vllm         │ 101   │ gpu-1 │ 0,1  │ http://10.0.0.5:41000 │ 45m00s left             │                                                  │
│ tiny-llama-1 │ tiny-llama │ -                  │ QUEUED   │ vllm         │ 102   │ -     │ -    │ -                     │ start not estimated yet │ Resources: waiting for a node with 2 free GPUs   │
│              │            │                    │          │              │       │       │      │                       │                         │ xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx… │
│ other-0      │ other      │ -                  │ CREATING │ transformers │ -     │ -     │ -    │ -                     │ -                       │                                                  │
│ pd-m-0       │ pd-m       │ prefill of pd-m-u0 │ STARTING │ vllm         │ 103+0 │ gpu-2 │ 3    │ -                     │ -                       │                                                  │
└──────────────┴────────────┴────────────────────┴──────────┴──────────────┴───────┴───────┴──────┴───────────────────────┴─────────────────────────┴──────────────────────────────────────────────────┘
tiny-llama: 1 of 3 replica(s) READY (restart=on-failure)
other: FAILED: crash loop: 3 failed starts in 600 s
"""  # noqa: E501

PS_ALL_TABLE = """\
┏━━━━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━┳━━━━━━━┳━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ replica      ┃ deployment ┃ role               ┃ state    ┃ engine       ┃ job   ┃ node  ┃ gpus ┃ endpoint              ┃ next                    ┃ detail                                           ┃
┡━━━━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━━╇━━━━━━━╇━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│ tiny-llama-0 │ tiny-llama │ -                  │ READY    │ vllm         │ 101   │ gpu-1 │ 0,1  │ http://10.0.0.5:41000 │ 45m00s left             │                                                  │
│ tiny-llama-1 │ tiny-llama │ -                  │ QUEUED   │ vllm         │ 102   │ -     │ -    │ -                     │ start not estimated yet │ Resources: waiting for a node with 2 free GPUs   │
│              │            │                    │          │              │       │       │      │                       │                         │ xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx… │
│ other-0      │ other      │ -                  │ CREATING │ transformers │ -     │ -     │ -    │ -                     │ -                       │                                                  │
│ pd-m-0       │ pd-m       │ prefill of pd-m-u0 │ STARTING │ vllm         │ 103+0 │ gpu-2 │ 3    │ -                     │ -                       │                                                  │
│ gone-0       │ gone       │ -                  │ FAILED   │ vllm         │ 99    │ -     │ -    │ -                     │ -                       │ engine exited 1                                  │
└──────────────┴────────────┴────────────────────┴──────────┴──────────────┴───────┴───────┴──────┴───────────────────────┴─────────────────────────┴──────────────────────────────────────────────────┘
tiny-llama: 1 of 3 replica(s) READY (restart=on-failure)
other: FAILED: crash loop: 3 failed starts in 600 s
"""  # noqa: E501

PILOTS_TABLE = """\
                                 pilot jobs
┏━━━━━━━━━┳━━━━━━━┳━━━━━━┳━━━━━━━━━┳━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━┓
┃ pilot   ┃ node  ┃ gpus ┃ state   ┃ job ┃ devices ┃ replicas              ┃
┡━━━━━━━━━╇━━━━━━━╇━━━━━━╇━━━━━━━━━╇━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━┩
│ p-gpu-1 │ gpu-1 │ 4    │ RUNNING │ 200 │ 0,1,2,3 │ tiny-llama-0, other-0 │
│ p-gpu-2 │ gpu-2 │ 2    │ PENDING │ -   │ -       │ -                     │
└─────────┴───────┴──────┴─────────┴─────┴─────────┴───────────────────────┘
"""


def test_ps_finds_the_broker_of_the_site_file(
    xhpc: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XHPC_STATE_DIR")
    site = tmp_path / "site.toml"
    site.write_text('state_dir = "site-state"\n')
    with serving(tmp_path / "site-state", ANSWERS):
        result = xhpc("--site", str(site), "ps")
    assert result.code == 0, result.err
    assert shown(result.out) == PS_TABLE


ALL_ENDED = {
    "/v1/replicas?all=0": (200, b"[]"),
    "/v1/replicas?all=1": (200, wire([FAILED, replica("gone-1", ReplicaState.FAILED)])),
    "/v1/deployments": (200, wire([DEPLOYMENTS[3]])),
}


def test_ps_with_every_replica_ended_says_so_and_how_to_see_them(
    xhpc: Run, clean_env: Path
) -> None:
    with serving(clean_env, ALL_ENDED):
        result = xhpc("ps")
    assert result.code == 0, result.err
    assert result.out == (
        "no live replicas; 2 ended (2 FAILED): `xhpc ps --all` lists them, "
        "`xhpc logs REPLICA` shows why one ended\n"
    )


def test_ps_with_no_replica_at_all_says_how_to_start_one(xhpc: Run, clean_env: Path) -> None:
    empty = {"/v1/replicas?all=0": (200, b"[]"), "/v1/replicas?all=1": (200, b"[]"),
             "/v1/deployments": (200, b"[]")}  # fmt: skip
    with serving(clean_env, empty):
        assert xhpc("ps").out == "no replicas (start one with `xhpc serve MODEL`)\n"
        assert xhpc("ps", "--all").out == "no replicas (start one with `xhpc serve MODEL`)\n"
        assert xhpc("ps", "--json").out == "[]\n"  # --json: the list as sent, empty


def test_an_autoscaled_deployment_s_note_says_its_policy_and_sleep() -> None:
    from xhpc.cli.observe.ps import deployment_notes

    policy = {"min_replicas": 0, "max_replicas": 4}
    dep = {"name": "m", "failed_reason": None, "replicas": [], "stopped": False,
           "restart": "always", "scaling": policy}  # fmt: skip
    assert deployment_notes([{**dep, "wanted": 0}]) == [
        "m: autoscaled 0..4, asleep (a request wakes it)"
    ]
    assert deployment_notes([{**dep, "wanted": 2}]) == [
        "m: autoscaled 0..4, 2 wanted now",
        "m: 0 of 2 replica(s) READY (restart=always)",
    ]
