"""bench/batch.py's table and targets from given figures, and its input (the run itself needs
the dev cluster and vLLM: `bench/batch.py`, docs/performance.md)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.batch import summarize, tokens_of, write_input


def test_the_table_says_each_rate_against_run_batch_and_checks_both_targets() -> None:
    figures = {
        "vllm run-batch": (100.0, 48, 1000),
        "xhpc batch": (105.0, 48, 1000),
        "online (xhpc serve + proxy)": (120.0, 48, 1000),
    }
    summary = summarize(figures, 48, (50, 48), 8)
    assert "| xhpc batch | 105.0 | 48/48 | 1000 | 9.5 | 0.95x |" in summary.text
    assert "2 redone" in summary.text
    targets = summary.data["targets"]
    assert [t["met"] for t in targets] == [True, True]
    slow = summarize({**figures, "xhpc batch": (200.0, 48, 1000)}, 48, (60, 48), 8)
    assert [t["met"] for t in slow.data["targets"]] == [False, False]
    assert all(set(t) == {"target", "value", "met"} for t in slow.data["targets"])


def test_answers_are_counted_from_their_usage(tmp_path: Path) -> None:
    requests = write_input(tmp_path / "in.jsonl", 3, 16)
    assert [
        json.loads(x)["custom_id"] for x in (tmp_path / "in.jsonl").read_text().splitlines()
    ] == [r["custom_id"] for r in requests]
    ok = {"response": {"status_code": 200, "body": {"usage": {"completion_tokens": 7}}}}
    bad = {"response": {"status_code": 400, "body": {}}, "error": {"message": "no"}}
    assert tokens_of([json.dumps(ok), json.dumps(ok), json.dumps(bad)]) == (2, 14)
