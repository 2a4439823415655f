"""bench/adapters.py's pure parts, without a cluster: the targets and the table from recorded
figures. The benchmark itself runs on the dev cluster (`.venv/bin/python bench/adapters.py
--json FILE`)."""

from __future__ import annotations

from typing import Any

from bench import adapters as ad


def _phase(key: str, rate: float, failed: int = 0) -> dict[str, Any]:
    return {"contender": key, "tokens_per_s": rate, "failed": failed, "tokens": int(rate * 20),
            "answers": 10, "seconds": 20.0}  # fmt: skip


def test_the_targets_and_the_table_from_recorded_figures() -> None:
    data: dict[str, Any] = {
        "phases": [_phase("base alone", 100.0), _phase("3 adapters", 90.0),
                   _phase("base alone", 110.0), _phase("3 adapters", 85.0, failed=1)],
        "load_first_s": [0.0, 0.0, 0.0],
        "load_replacement_s": [0.0, 0.4, 1.2],
    }  # fmt: skip
    found = ad.targets(data)
    assert [t["target"] for t in found] == [ad.TARGET_THROUGHPUT, ad.TARGET_LOAD]
    assert [t["met"] for t in found] == [True, True]
    assert all(set(t) == {"target", "value", "met"} for t in found)
    assert found[0]["value"].startswith("0.83x") and found[1]["value"] == "worst 1.200 s"
    data["targets"] = found
    text = ad.table(data)
    assert (
        "| tokens/s: median [min, max] | 105.0 [100.0, 110.0] | 87.5 [85.0, 90.0] | 0.83x |" in text
    )
    assert "| failed requests | 0 | 1 | |" in text
    assert f"MET  {ad.TARGET_LOAD}: worst 1.200 s" in text


def test_slow_adapters_a_late_load_or_nothing_measured_are_not_met() -> None:
    slow = {"phases": [_phase("base alone", 100.0), _phase("3 adapters", 70.0)],
            "load_first_s": [0.0, 2.5, 0.0], "load_replacement_s": [0.0, 0.0, 0.0]}  # fmt: skip
    assert [t["met"] for t in ad.targets(slow)] == [False, False]
    unloaded = {**slow, "load_replacement_s": [0.0, None, 0.0]}
    (_, load) = ad.targets(unloaded)
    assert load["met"] is False and load["value"] == "not measured"
    (through, _) = ad.targets({})
    assert through == {"target": ad.TARGET_THROUGHPUT, "value": "not measured", "met": False}
