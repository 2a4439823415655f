"""bench/failover.py's pure parts (its targets and table from recorded figures), and the whole
run on the dev cluster's two login nodes: the leading login node killed under traffic through
both gateways, a replica's job cancelled meanwhile, then the new leader frozen past its lease
(`.venv/bin/python bench/failover.py --json FILE`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import failover as f
from bench._failover import figures as fig
from tests.conftest import ROOT, slurm_env


def _figures(**over: Any) -> dict[str, Any]:
    calls = [{"contender": "one address", "at": 1.0, "took": 0.1, "error": ""},
             {"contender": "one address", "at": 9.0, "took": 32.0, "error": "APITimeoutError"},
             {"contender": "both addresses", "at": 1.0, "took": 0.1, "error": ""},
             {"contender": "both addresses", "at": 9.0, "took": 10.4, "error": ""}]  # fmt: skip
    data: dict[str, Any] = {
        "calls": calls, "takeover_s": 6.6, "replaced_s": 13.0, "freeze_takeover_s": 6.1,
        "jobs": {"duplicates": 0, "lost": 0}, "fenced": {"exit": 4, "submitted": 0},
        "standby_gateway": {"answered": fig.STANDBY_CALLS, "relayed": True}, "woken_s": 21.0,
        "handover": {"ready_left_s": 41.0, "by_new_leader": True},
    }  # fmt: skip
    data.update(over)
    return data


def test_the_targets_met_and_the_table() -> None:
    data = _figures()
    found = fig.targets(data)
    assert [t["target"] for t in found] == [fig.TARGET_TAKEOVER, fig.TARGET_FAILED, fig.TARGET_JOBS,
                                            fig.TARGET_REPLACED, fig.TARGET_FENCED,
                                            fig.TARGET_RELAYED, fig.TARGET_WOKEN,
                                            fig.TARGET_HANDOVER]  # fmt: skip
    assert all(t["met"] for t in found), found
    data["targets"] = found
    text = fig.table(data)
    assert "| figure | one address | both addresses |" in text
    assert "| failed calls | 1 | 0 |" in text
    assert "| slowest answered call (s) | 0.1 | 10.4 |" in text
    assert "| login node killed: the standby leads after (s) | 6.6 |" in text
    assert f"MET  {fig.TARGET_FENCED}: exit 4, 0 submitted" in text
    assert f"MET  {fig.TARGET_RELAYED}: 10 of 10 answered, relayed" in text
    assert "| a call to an asleep deployment meanwhile: answered after (s) | 21 |" in text
    assert "successor submitted by the new leader, READY 41 s before the job's end" in text


@pytest.mark.parametrize(
    ("over", "missed"),
    [
        ({"takeover_s": 10.5}, fig.TARGET_TAKEOVER),
        ({"takeover_s": None}, fig.TARGET_TAKEOVER),
        ({"replaced_s": None}, fig.TARGET_REPLACED),
        ({"jobs": {"duplicates": 1, "lost": 0}}, fig.TARGET_JOBS),
        ({"jobs": {"duplicates": 0, "lost": 1}}, fig.TARGET_JOBS),
        ({"jobs": {}}, fig.TARGET_JOBS),
        ({"fenced": {"exit": 0, "submitted": 0}}, fig.TARGET_FENCED),
        ({"fenced": {"exit": 4, "submitted": 1}}, fig.TARGET_FENCED),
        ({"calls": []}, fig.TARGET_FAILED),
        ({"standby_gateway": {"answered": 9, "relayed": True}}, fig.TARGET_RELAYED),
        ({"standby_gateway": {"answered": 10, "relayed": False}}, fig.TARGET_RELAYED),
        ({"standby_gateway": {}}, fig.TARGET_RELAYED),
        ({"woken_s": None}, fig.TARGET_WOKEN),
        ({"handover": {"ready_left_s": None}}, fig.TARGET_HANDOVER),
        ({"handover": {"ready_left_s": 30.0, "by_new_leader": False}}, fig.TARGET_HANDOVER),
        ({"handover": {}}, fig.TARGET_HANDOVER),
        ({"calls": [{"contender": "both addresses", "at": 1.0, "took": 1.0, "error": "x"}]},
         fig.TARGET_FAILED),
    ],
)  # fmt: skip
def test_each_target_can_be_missed(over: dict[str, Any], missed: str) -> None:
    found = {t["target"]: t["met"] for t in fig.targets(_figures(**over))}
    assert found[missed] is False
    assert all(met for target, met in found.items() if target != missed)


def test_an_answer_counts_only_when_whole() -> None:
    class Msg:
        content = "gpus=0"

    class Choice:
        message = Msg()

    class Answer:
        id = "chatcmpl-echo-4000"
        choices = [Choice()]

    assert f.answer_error(200, Answer()) == ""
    assert f.answer_error(503, Answer()).startswith("HTTP 503")
    Answer.id = "other"
    assert f.answer_error(200, Answer()) != ""
    assert f.answer_error(200, object()) != ""


@pytest.mark.cluster
def test_the_failover_run_on_the_dev_cluster_meets_its_targets(
    dev_cluster: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The benchmark end to end (about two minutes): both login nodes, PostgreSQL, traffic through
    both gateways; every target met, and the client of one address lost calls (the contrast
    the table shows)."""
    out = tmp_path / "failover.json"
    argv = [sys.executable, str(ROOT / "bench" / "failover.py"), "--json", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, env=slurm_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| figure | one address | both addresses |" in proc.stdout
    data = json.loads(out.read_text())
    targets = {t["target"]: t for t in data["targets"]}
    assert len(targets) == 8 and all(t["met"] for t in targets.values()), proc.stdout
    lost = [c for c in data["calls"] if c["contender"] == "one address" and c["error"]]
    assert lost, "the client of login 2's gateway alone lost a call while login 2 was down"
    assert "lost its lease" in data["fenced"]["last_line"]
