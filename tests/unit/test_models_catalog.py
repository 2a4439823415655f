"""`xhpc models`: the site catalog and the member's own, as the CLI shows and changes them, and
how `serve` resolves a name from both (a member's model reaches the broker as the request for
its weights; the broker never reads the member's file)."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from tests.unit.conftest import Run, one_error_line
from tests.unit.test_cli_client import serving
from xhpc.catalog import catalog_toml, expand_request, find_entry
from xhpc.config import load_user_catalog, save_user_catalog, user_catalog_path
from xhpc.errors import ConfigError, NotFoundError
from xhpc.models import EngineKind, ServeRequest
from xhpc.settings import ModelEntry, XhpcConfig


@pytest.fixture
def catalog_file(clean_env: Path, tmp_path: Path) -> Path:
    """Where this test's member catalog lives (XDG_CONFIG_HOME is under tmp_path)."""
    path = user_catalog_path()
    assert path == tmp_path / "xdg-config" / "xhpc" / "models.toml"
    return path


def site(**models: ModelEntry) -> XhpcConfig:
    return XhpcConfig(models=models)


# -- the file ---------------------------------------------------------------------------------
def test_the_catalog_sits_next_to_the_user_config(tmp_path: Path) -> None:
    env = {"XHPC_USER_CONFIG": str(tmp_path / "conf" / "mine.toml")}
    assert user_catalog_path(env) == tmp_path / "conf" / "models.toml"
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert user_catalog_path(env) == tmp_path / "xdg" / "xhpc" / "models.toml"


def test_save_writes_an_owner_only_file_that_loads_back(catalog_file: Path) -> None:
    hostile = 'a "quoted" \\ back\\slash, ünï, ] = 1 # [models.x] \\u0041'
    entries = {
        "m.1": ModelEntry(
            path=Path("/w/m"),
            engine=EngineKind.VLLM,
            gpus=2,
            engine_args=["--max-model-len", "512", hostile],
            description=hostile,
        ),
        "h": ModelEntry(hf_id="Org/Name-1.5B"),
        "d": ModelEntry(path=Path("/w/with\x7fdel")),  # a hand-written path: TOML escapes DEL
    }
    for control in ("tab\there", "new\nline", "del\x7f"):
        with pytest.raises(ValueError, match="control characters"):
            ModelEntry(engine_args=[control])
        with pytest.raises(ValueError, match="control characters"):
            ModelEntry(description=control)
    assert save_user_catalog(entries) == catalog_file
    assert load_user_catalog() == entries
    assert stat.S_IMODE(catalog_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(catalog_file.parent.stat().st_mode) == 0o700
    assert catalog_toml({}).strip() == ""


def test_a_failed_write_leaves_the_old_catalog_whole(
    catalog_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_user_catalog({"old": ModelEntry(hf_id="o/old")})
    before = catalog_file.read_bytes()

    def broken(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        save_user_catalog({"new": ModelEntry(hf_id="n/new")})
    assert catalog_file.read_bytes() == before
    assert sorted(p.name for p in catalog_file.parent.iterdir()) == ["models.toml"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[other]\nx = 1\n", "unknown key(s) other"),
        ('[models."a;b"]\nhf_id = "o/m"\n', "invalid model name a;b"),
        ('[models.m]\nengine = "nope"\n', "model 'm', engine"),
        ('[models.m]\nweights = "/x"\n', "unknown key; valid keys: description, engine"),
        ("[models\n", "not valid TOML"),
    ],
)
def test_a_bad_catalog_file_is_one_config_error(
    catalog_file: Path, text: str, message: str
) -> None:
    catalog_file.parent.mkdir(parents=True)
    catalog_file.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_user_catalog()
    assert message in info.value.one_line()
    assert str(catalog_file) in info.value.one_line()


# -- the commands ------------------------------------------------------------------------------
def test_add_list_show_rm(xhpc: Run, catalog_file: Path, model_dir: Path) -> None:
    added = xhpc(
        "models", "add", "mine", "--path", str(model_dir), "--engine", "transformers",
        "--gpus", "2", "--engine-arg=--max-model-len", "--engine-arg", "512",
        "--description", "my model",
    )  # fmt: skip
    assert added.code == 0, added.err
    assert added.out.strip() == f"added mine to {catalog_file}"
    listed = xhpc("models", "list", "--json")
    rows = {r["name"]: r for r in json.loads(listed.out)}
    assert rows["mine"] == {
        "name": "mine", "source": "user", "engine": "transformers", "gpus": 2,
        "shadowed": False, "description": "my model", "cached": None,  # no broker to ask
    }  # fmt: skip
    assert rows["tiny-llama"]["source"] == "site" and rows["tiny-llama"]["engine"] == "vllm"
    shown = json.loads(xhpc("models", "show", "mine", "--json").out)
    assert shown["path"] == str(model_dir) and shown["staged"] is True
    assert shown["engine_args"] == ["--max-model-len", "512"]
    assert shown["served_name"] == "mine" and shown["hf_id"] is None
    text = xhpc("models", "show", "mine").out
    assert "--max-model-len 512" in text and "user catalog" in text
    table = xhpc("models", "list").out
    assert "mine" in table and "transformers" in table and "tiny-llama" in table
    removed = xhpc("models", "rm", "mine")
    assert removed.code == 0 and "removed mine" in removed.out
    assert load_user_catalog() == {}
    assert "mine" not in xhpc("models", "list").out


def test_where_the_cache_holds_a_model_by_the_name_its_weights_go_by(
    xhpc: Run, catalog_file: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site model's copies go by its catalog name; a member's entry is served as its
    directory, so its copies go by the directory's name."""
    from xhpc.cli.admin import models as cli_models

    ledger = {"tiny-llama": ["shared", "n2"], model_dir.name: ["n1"]}
    monkeypatch.setattr(cli_models, "_cached", lambda ctx: ledger)
    assert xhpc("models", "add", "mine", "--path", str(model_dir)).code == 0
    rows = {r["name"]: r for r in json.loads(xhpc("models", "list", "--json").out)}
    assert (rows["tiny-llama"]["cached"], rows["mine"]["cached"]) == (["n2", "shared"], ["n1"])
    assert re.search(r"^cached +n1$", xhpc("models", "show", "mine").out, re.M)
    assert "n2, shared" in xhpc("models", "list").out


def test_hf_id_without_path_is_looked_for_under_models_dir(
    xhpc: Run, catalog_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = xhpc("models", "add", "q", "--hf-id", "Qwen/Qwen2.5-0.5B-Instruct")
    assert "needs the site's models_dir" in one_error_line(refused)
    monkeypatch.setenv("XHPC_MODELS_DIR", str(tmp_path / "weights"))
    assert xhpc("models", "add", "q", "--hf-id", "Qwen/Qwen2.5-0.5B-Instruct").code == 0
    shown = json.loads(xhpc("models", "show", "q", "--json").out)
    assert shown["path"] == str(tmp_path / "weights" / "Qwen2.5-0.5B-Instruct")
    assert shown["staged"] is False and shown["hf_id"] == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["a;b"], 2, "invalid model name a;b"),
        (["m"], 2, "pass --path (the weights' directory) or --hf-id"),
        (["m", "--path", "/no/such/dir"], 3, "no model at /no/such/dir"),
        (["m", "--path", "{model}", "--engine", "tgi"], 2, "unknown engine 'tgi'; engines: vllm"),
        (["m", "--path", "{model}", "--gpus", "0"], 2, "--gpus must be at least 1"),
        (["m", "--path", "{model}", "--engine-arg", "a\nb"], 2, "contain control characters"),
        (["m", "--path", "{model}", "--engine-arg", "; rm -rf /"], 2, "each must be one word of"),
        (["m", "--hf-id", "not an id"], 2, "--hf-id: invalid Hugging Face id"),
        (["tiny-llama", "--path", "{model}"], 2, "in the site catalog; your catalog may not"),
    ],
)
def test_add_refuses_bad_input_in_one_line_and_writes_nothing(
    xhpc: Run, catalog_file: Path, model_dir: Path, args: list[str], code: int, message: str
) -> None:
    result = xhpc("models", "add", *[a.replace("{model}", str(model_dir)) for a in args])
    assert result.code == code
    assert message in one_error_line(result)
    assert result.out == ""
    assert not catalog_file.exists()


def test_add_refuses_a_duplicate(xhpc: Run, catalog_file: Path, model_dir: Path) -> None:
    assert xhpc("models", "add", "m", "--path", str(model_dir)).code == 0
    before = catalog_file.read_text()
    again = xhpc("models", "add", "m", "--path", str(model_dir), "--gpus", "4")
    assert again.code == 2
    assert "already in your catalog" in one_error_line(again)
    assert catalog_file.read_text() == before


def test_rm_leaves_the_site_catalog_alone(xhpc: Run, catalog_file: Path) -> None:
    result = xhpc("models", "rm", "tiny-llama")
    assert result.code == 2
    assert "site catalog, which members cannot change" in one_error_line(result)
    missing = xhpc("models", "rm", "nope")
    assert missing.code == 3 and "not in your catalog" in one_error_line(missing)
    assert xhpc("models", "show", "nope").code == 3


def test_a_hidden_member_entry_is_listed_and_warned_about(
    xhpc: Run, catalog_file: Path, model_dir: Path
) -> None:
    # written by hand (or before the site added the name): `add` itself refuses it
    save_user_catalog({"tiny-llama": ModelEntry(path=model_dir, gpus=3)})
    listed = xhpc("models", "list", "--json")
    mine = [r for r in json.loads(listed.out) if r["name"] == "tiny-llama"]
    assert [(r["source"], r["shadowed"]) for r in mine] == [("site", False), ("user", True)]
    assert "hidden by the site catalog's model" in listed.err
    shown = xhpc("models", "show", "tiny-llama", "--json")
    assert json.loads(shown.out)["source"] == "site" and "hidden" in shown.err


# -- serve resolves names from both catalogs ----------------------------------------------------
def test_a_member_entry_becomes_a_request_for_its_weights(model_dir: Path) -> None:
    user = {
        "mine": ModelEntry(
            path=model_dir, engine=EngineKind.TRANSFORMERS, gpus=2, engine_args=["--a", "1"]
        )
    }
    req, warning = expand_request(
        ServeRequest(model="mine", engine_args=("--b",)), site(), user, gpus_given=False
    )
    assert warning is None
    assert (req.model, req.name, req.engine, req.gpus) == (
        str(model_dir), "mine", EngineKind.TRANSFORMERS, 2
    )  # fmt: skip
    assert req.engine_args == ("--a", "1", "--b")
    req, _ = expand_request(
        ServeRequest(model="mine", name="other", gpus=4, engine=EngineKind.VLLM),
        site(),
        user,
        gpus_given=True,
    )
    assert (req.name, req.gpus, req.engine) == ("other", 4, EngineKind.VLLM)


def test_a_site_entry_keeps_its_name_and_lends_its_defaults(tmp_path: Path) -> None:
    config = site(big=ModelEntry(path=tmp_path, gpus=8, engine_args=["--tp", "8"]))
    req, _ = expand_request(ServeRequest(model="big"), config, {}, gpus_given=False)
    assert (req.model, req.name, req.gpus, req.engine_args) == ("big", None, 8, ("--tp", "8"))
    plain = ServeRequest(model="plain")
    config = site(plain=ModelEntry(path=tmp_path))
    assert expand_request(plain, config, {}, gpus_given=False) == (plain, None)
    for model in (str(tmp_path), "a;b", "unknown"):
        untouched = ServeRequest(model=model)
        assert expand_request(untouched, config, {}, gpus_given=False) == (untouched, None)


def test_the_site_wins_a_name_in_both_with_a_warning(tmp_path: Path, model_dir: Path) -> None:
    config = site(m=ModelEntry(path=tmp_path, gpus=1))
    req, warning = expand_request(
        ServeRequest(model="m"), config, {"m": ModelEntry(path=model_dir, gpus=4)}, gpus_given=False
    )
    assert req.model == "m" and req.gpus == 1
    assert warning is not None and "xhpc models rm m" in warning


def test_unknown_and_unstaged_names(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError) as info:
        find_entry("nope", site(a=ModelEntry(hf_id="o/a")), {"b": ModelEntry(hf_id="o/b")})
    assert "catalog models: a, b" in info.value.one_line()
    user = {"gone": ModelEntry(path=tmp_path / "gone")}
    with pytest.raises(NotFoundError, match="not staged"):
        expand_request(ServeRequest(model="gone"), site(), user, gpus_given=False)


def test_serve_sends_the_member_model_as_a_path_request(
    xhpc: Run, clean_env: Path, catalog_file: Path, model_dir: Path
) -> None:
    save_user_catalog(
        {"mine": ModelEntry(path=model_dir, engine=EngineKind.VLLM, gpus=2, engine_args=["--x"])}
    )
    view = {"name": "mine", "model": str(model_dir), "model_path": str(model_dir),
            "engine": "vllm", "gpus": 2}  # fmt: skip
    with serving(clean_env, {"/v1/serve": (200, json.dumps(view).encode())}) as broker:
        result = xhpc("serve", "mine", "--detach", "--json", "--engine-arg", "--y")
    assert result.code == 0, result.err
    ((method, path, _, body),) = broker.seen
    sent = ServeRequest.model_validate_json(body)
    assert (method, path) == ("POST", "/v1/serve")
    assert (sent.model, sent.name, sent.gpus, sent.engine) == (
        str(model_dir), "mine", 2, EngineKind.VLLM
    )  # fmt: skip
    assert sent.engine_args == ("--x", "--y")


def test_a_members_entry_carries_an_engine_config_through_the_file_and_into_serve(
    xhpc: Run, catalog_file: Path, model_dir: Path
) -> None:
    cfg = (
        '{"tool_call_parser": "hermes", "enable_auto_tool_choice": true, '
        '"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}'
    )
    added = xhpc(
        "models", "add", "tools", "--path", str(model_dir), "--engine", "vllm",
        "--engine-config", cfg,
    )  # fmt: skip
    assert added.code == 0, added.err
    entry = load_user_catalog()["tools"]  # written as TOML, read back the same
    assert entry.engine_config is not None and entry.engine_config.tool_call_parser == "hermes"
    assert entry.engine_config.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 2,
    }
    shown = json.loads(xhpc("models", "show", "tools", "--json").out)
    assert shown["engine_config_args"][:3] == [
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
    ]
    assert "--enable-auto-tool-choice" in xhpc("models", "show", "tools").out
    req, _ = expand_request(
        ServeRequest(model="tools"), XhpcConfig(), load_user_catalog(), gpus_given=False
    )
    assert req.engine_config == entry.engine_config  # the entry's config reaches the broker


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("{oops", "--engine-config: not valid JSON"),
        ("[1]", "--engine-config: a JSON object is needed"),
        ('{"tool_call_parser": "a b"}', "--engine-config: tool_call_parser:"),
        ('{"chat_template": "/etc/shadow"}', "--engine-config: chat_template:"),
        ('{"enable_lora": true}', "--engine-config: enable_lora:"),
    ],
)
def test_a_bad_engine_config_is_a_one_line_error_and_changes_nothing(
    xhpc: Run, catalog_file: Path, model_dir: Path, value: str, needle: str
) -> None:
    for argv in (
        ("models", "add", "bad", "--path", str(model_dir), "--engine-config", value),
        ("serve", str(model_dir), "--engine", "vllm", "--engine-config", value, "--dry-run"),
        ("run-server", str(model_dir), "--engine", "vllm", "--gpus", "0", "--engine-config", value),
    ):
        refused = xhpc(*argv)
        assert refused.code == 2, refused.err
        assert needle in refused.err and len(refused.err.strip().splitlines()) == 1, refused.err
    assert not catalog_file.exists()
