"""bench/multinode.py's pure parts, without a cluster: vec-inf's two-node config, the targets
and the table from recorded figures. The benchmark itself runs on the dev cluster
(`.venv/bin/python bench/multinode.py --json FILE`)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import multinode as mn


def _run(key: str, rnd: int, first: float | None, error: str | None = None) -> dict[str, Any]:
    return {"contender": key, "round": rnd, "first_200_s": first, "error": error}


def test_vec_inf_s_config_becomes_two_nodes_with_the_pipeline_across() -> None:
    text = 'num_nodes: 1\nvllm_args: {"--dtype": "float32"}\n'
    two = mn.two_node_config(text)
    assert "num_nodes: 2" in two
    assert '{"--pipeline-parallel-size": "2", "--dtype": "float32"}' in two
    with pytest.raises(RuntimeError):
        mn.two_node_config("num_nodes: 3\n")


def test_the_targets_from_recorded_figures() -> None:
    launch = [_run("xhpc-2", 0, 50.0), _run("xhpc-1", 0, 30.0), _run("vec-inf-2", 0, 60.0),
              _run("xhpc-2", -1, 500.0)]  # fmt: skip
    data: dict[str, Any] = {
        "launch": launch,
        "loss": {"out_of_rotation_s": 3.1, "replacement_ready_s": 80.0},
        "handover": {"handed_over_s": 200.0, "requests": 40, "failed": []},
    }
    found = mn.targets(data)
    assert [t["target"] for t in found] == [mn.TARGET_LAUNCH, mn.TARGET_LOSS, mn.TARGET_HANDOVER]
    assert [t["met"] for t in found] == [True, True, True]
    assert all(set(t) == {"target", "value", "met"} for t in found)
    data["targets"] = found
    text = mn.table(data)
    assert "| launch -> first answer | xhpc 2 nodes / 1 node | 1.67x |" in text
    assert "xhpc 2 nodes | 50.0 [50.0, 50.0]" in text

    slow = {
        **data,
        "loss": {"out_of_rotation_s": 7.0, "replacement_ready_s": 80.0},
        "handover": {"handed_over_s": 200.0, "requests": 40, "failed": ["HTTP 502"]},
    }
    assert [t["met"] for t in mn.targets(slow)] == [True, False, False]


def test_a_vec_inf_job_that_never_answers_is_not_a_met_target() -> None:
    launch = [_run("xhpc-2", 0, 50.0), _run("vec-inf-2", 0, None, "job FAILED: ray: not found")]
    (t,) = mn.targets({"launch": launch})
    assert t["met"] is False and "not measured" in t["value"] and "ray" in t["value"]
