"""Keys tied to Slurm identity: a key's user is a Unix user and its account one of that user's
Slurm associations on this cluster (sacctmgr, read through the Slurm client); without Slurm
accounting the account stays a free label and the key's creation says so."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner

from tests.unit.test_broker_service import RecordingSlurm, make
from xhpc.access import KeyCreate, KeyCreated
from xhpc.broker.admit.key_identity import check_key_identity, unix_user_exists
from xhpc.broker.api import control_app
from xhpc.broker.service import BrokerService
from xhpc.cli.admin.keys import keys
from xhpc.cli.context import Ctx
from xhpc.client.control import Client
from xhpc.config import load_config
from xhpc.errors import BrokerError, SlurmError, SlurmParseError, ValidationError
from xhpc.models import NodeInfo
from xhpc.settings import SlurmConfig
from xhpc.slurm import argv as A
from xhpc.slurm.client import CliSlurmClient
from xhpc.slurm.partitions import accounting_enabled, parse_scontrol_config, parse_user_accounts

pytestmark = pytest.mark.security

Output = Callable[[str], str]
ME = pwd.getpwuid(os.getuid()).pw_name  # a Unix user that exists wherever the tests run
NOBODY = "no-such-user-xhpc"  # and one that does not


class AccountingSlurm(RecordingSlurm):
    """The recording fake with a storage type and each user's associations on this cluster."""

    def __init__(self, nodes: list[NodeInfo], store: Any, fail_on: int | None = None) -> None:
        super().__init__(nodes, store, fail_on)
        self.storage = "accounting_storage/slurmdbd"
        self.accounts: dict[str, list[str]] = {ME: ["lab1", "root"]}
        self.asked: list[str] = []
        self.config_fails = False

    async def accounting_storage_type(self) -> str:
        if self.config_fails:
            raise SlurmError("scontrol show config failed", argv=["scontrol"], returncode=1)
        return self.storage

    async def user_accounts(self, user: str) -> list[str]:
        self.asked.append(user)
        return self.accounts.get(user, [])


def service_with(
    tmp_path: Path, nodes: list[NodeInfo], storage: str = "accounting_storage/slurmdbd"
) -> tuple[BrokerService, AccountingSlurm]:
    service, slurm = make(tmp_path, nodes, slurm_cls=AccountingSlurm)
    assert isinstance(slurm, AccountingSlurm)
    slurm.storage = storage
    return service, slurm


# -- the check, through the broker's service ------------------------------------------------------


async def test_a_user_unknown_to_unix_is_refused_and_nothing_is_stored(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    service, slurm = service_with(tmp_path, idle_nodes)
    with pytest.raises(ValidationError, match=f"no Unix user '{NOBODY}'"):
        await service.create_key(KeyCreate(user=NOBODY, account="lab1"))
    assert service.keys.all() == [] and slurm.asked == []


async def test_an_account_outside_the_users_associations_is_refused(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    service, slurm = service_with(tmp_path, idle_nodes)
    with pytest.raises(ValidationError) as refused:
        await service.create_key(KeyCreate(user=ME, account="lab2"))
    assert refused.value.one_line() == (
        f"user '{ME}' may not use Slurm account 'lab2' (their associations on this cluster: "
        f"lab1, root) (hint: pick one of theirs, or: sacctmgr add user {ME} account=lab2)"
    )
    slurm.accounts = {}  # a user Slurm accounting does not know at all
    with pytest.raises(ValidationError, match="their associations on this cluster: none"):
        await service.create_key(KeyCreate(user=ME, account="lab1"))
    assert service.keys.all() == [] and slurm.asked == [ME, ME]


async def test_an_account_of_the_users_associations_is_accepted(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    service, slurm = service_with(tmp_path, idle_nodes)
    made = await service.create_key(KeyCreate(user=ME, account="lab1", rpm=5))
    assert made.warning is None
    assert (made.view.user, made.view.account, made.view.rpm) == (ME, "lab1", 5)
    assert [k.key_id for k in service.keys.all()] == [made.view.key_id]
    # Without an account the key is charged to none: only its user is checked.
    bare = await service.create_key(KeyCreate(user=ME))
    assert bare.warning is None and bare.view.account is None
    assert slurm.asked == [ME]


async def test_without_accounting_the_account_is_a_free_label_and_says_so(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    service, slurm = service_with(tmp_path, idle_nodes, storage="accounting_storage/none")
    made = await service.create_key(KeyCreate(user=ME, account="anything"))
    assert made.view.account == "anything"
    assert made.warning is not None
    assert "no accounting" in made.warning and "'anything' is a free label" in made.warning
    assert slurm.asked == []  # no associations to ask about
    # The user is still checked: a Unix user, accounting or not.
    with pytest.raises(ValidationError, match="no Unix user"):
        await service.create_key(KeyCreate(user=NOBODY, account="anything"))


async def test_when_slurm_cannot_say_whether_it_keeps_accounting_no_key_is_made(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    service, slurm = service_with(tmp_path, idle_nodes)
    slurm.config_fails = True
    with pytest.raises(SlurmError, match="scontrol show config failed"):
        await service.create_key(KeyCreate(user=ME, account="lab2"))
    assert service.keys.all() == []


async def test_the_check_alone_takes_a_user_lookup() -> None:
    slurm = AccountingSlurm([], None)
    slurm.accounts = {"alice": ["lab2"]}
    req = KeyCreate(user="alice", account="lab2")
    assert await check_key_identity(req, slurm, True, user_exists=lambda u: u == "alice") is None
    with pytest.raises(ValidationError, match="no Unix user 'alice'"):
        await check_key_identity(req, slurm, True, user_exists=lambda u: False)
    assert unix_user_exists(ME) and not unix_user_exists(NOBODY)


# -- over the control API and the CLI -------------------------------------------------------------


async def test_the_api_answers_a_refusal_with_a_400(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    service, _ = service_with(tmp_path, idle_nodes)
    async with TestClient(TestServer(control_app(service))) as client:
        refused = await client.post("/v1/keys", json={"user": ME, "account": "lab2"})
        assert refused.status == 400
        error = (await refused.json())["error"]
        assert error["code"] == "invalid_request"
        assert "may not use Slurm account 'lab2'" in error["message"]
        made = await client.post("/v1/keys", json={"user": ME, "account": "lab1"})
        assert made.status == 200, await made.text()
        body = KeyCreated.model_validate(await made.json())
        assert body.view.account == "lab1" and body.warning is None


@dataclass
class FakeBroker:
    answer: Any
    posted: list[str] = field(default_factory=list)

    def post(self, path: str, body: str) -> Any:
        self.posted.append(body)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@dataclass
class FakeCtx(Ctx):
    fake: FakeBroker | None = None

    @property
    def broker(self) -> Any:
        return Client.over(self.fake)  # type: ignore[arg-type]


def _made(warning: str | None) -> Any:
    view = {"key_id": "0123456789ab", "user": "alice", "created_at": "2026-01-01T00:00:00Z"}
    made = KeyCreated.model_validate({"view": view, "key": "xhpc-k", "warning": warning})
    return json.loads(made.model_dump_json())


def test_the_cli_prints_the_warning_on_stderr_and_a_refusal_fails(clean_env: Path) -> None:
    config, sources = load_config()
    args = ["create", "--user", "alice", "--account", "lab9"]
    warned = FakeBroker(_made("account 'lab9' is a free label"))
    ctx = FakeCtx(config=config, sources=sources, fake=warned)
    result = CliRunner().invoke(keys, args, obj=ctx)
    assert result.exit_code == 0, result.output
    assert "warning: account 'lab9' is a free label" in result.stderr
    assert "xhpc-k" in result.stdout and "warning" not in result.stdout

    message = "user 'alice' may not use Slurm account 'lab9' (their associations: lab2)"
    refusal = BrokerError(message, status=400, code="invalid_request")
    ctx = FakeCtx(config=config, sources=sources, fake=FakeBroker(refusal))
    result = CliRunner().invoke(keys, args, obj=ctx)
    assert result.exit_code != 0 and isinstance(result.exception, BrokerError)
    assert "xhpc-k" not in result.output


# -- the adapter: argv, parser on real sacctmgr output, and the client -----------------------------


def test_the_associations_argv() -> None:
    assert A.sacctmgr_user_associations("alice", Path("/opt/slurm/bin")) == [
        "/opt/slurm/bin/sacctmgr",
        "--noheader",
        "--parsable2",
        "show",
        "associations",
        "where",
        "user=alice",
        "format=cluster,account",
    ]


def test_only_this_clusters_associations_count(slurm_output: Output) -> None:
    member = slurm_output("sacctmgr-assoc-member.txt")  # lab9 on cluster "other", lab2 here
    assert parse_user_accounts(member, "xhpcdev") == ["lab2"]
    assert parse_user_accounts(member, "other") == ["lab9"]
    assert parse_user_accounts(member, None) == ["lab9", "lab2"]
    root = slurm_output("sacctmgr-assoc-root.txt")
    assert parse_user_accounts(root, "xhpcdev") == ["lab1", "root"]
    assert parse_user_accounts(root, None) == ["lab1", "root"]  # each once
    assert parse_user_accounts("", "xhpcdev") == []  # no association at all
    with pytest.raises(SlurmParseError, match=r"not CLUSTER\|ACCOUNT"):
        parse_user_accounts("xhpcdev lab2\n", "xhpcdev")


def test_the_accounting_capture_is_slurmdbd(slurm_output: Output) -> None:
    config = parse_scontrol_config(slurm_output("scontrol-show-config-slurmdbd.txt"))
    assert config["ClusterName"] == "xhpcdev"
    assert accounting_enabled(config["AccountingStorageType"])


def test_the_client_asks_sacctmgr_for_this_clusters_accounts(tmp_path: Path) -> None:
    """The adapter through stand-in `scontrol` and `sacctmgr` that print the real captures."""
    data = Path(__file__).resolve().parent.parent / "data" / "slurm"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, capture in (
        ("scontrol", "scontrol-show-config-slurmdbd.txt"),
        ("sacctmgr", "sacctmgr-assoc-member.txt"),
    ):
        script = bin_dir / name
        script.write_text(
            f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/calls\ncat {data}/{capture}\n'
        )
        script.chmod(0o755)
    client = CliSlurmClient(SlurmConfig(bin_dir=bin_dir))
    assert asyncio.run(client.user_accounts("xhpc-member")) == ["lab2"]
    calls: Sequence[str] = (tmp_path / "calls").read_text().splitlines()
    assert calls == [
        "scontrol show config",
        "sacctmgr --noheader --parsable2 show associations where user=xhpc-member "
        "format=cluster,account",
    ]


async def test_a_new_key_is_usable_once_create_returns(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    """Creating a key waits until every proxy heard from lately fetched the grants again."""
    service, _ = service_with(tmp_path, idle_nodes)
    service.proxies.grants_for("proxy-a")
    service.proxies.grants_for("proxy-b")
    creating = asyncio.create_task(service.create_key(KeyCreate(user=ME, account="lab1")))
    await asyncio.sleep(0.2)
    assert not creating.done()  # neither proxy has the key yet
    assert service.proxies.grants_for("proxy-a").keys  # a's sync carries it
    await asyncio.sleep(0.2)
    assert not creating.done()  # b's has not
    made = await asyncio.wait_for(_after(service.proxies.grants_for, "proxy-b", creating), 5)
    assert made.view.key_id in {k.key_id for k in service.proxies.grants_for("proxy-b").keys}


async def _after(
    sync: Callable[[str], object], proxy: str, task: asyncio.Task[KeyCreated]
) -> KeyCreated:
    sync(proxy)
    return await task
