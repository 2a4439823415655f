"""A catalog model's parallel layout: its shape, its engine flags, and admission's check."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from xhpc.models import NodeInfo
from xhpc.placement.layout import layout_engine_args, layout_problems
from xhpc.settings import ModelEntry, ParallelLayout


def node(name: str, gpus: int, gpu_type: str | None = "h100", state: str = "IDLE") -> NodeInfo:
    return NodeInfo(name=name, address=name, state=state, partitions=("gpu",), gpus_total=gpus,
                    gpu_type=gpu_type)  # fmt: skip


def test_a_layout_is_tp_gpus_on_each_of_pp_nodes_unless_told_otherwise() -> None:
    layout = ParallelLayout(tp=8, pp=2)
    assert (layout.world, layout.per_node, layout.nodes) == (16, 8, 2)
    wide = ParallelLayout(tp=16, gpus_per_node=8)  # tensor parallel across two nodes
    assert (wide.world, wide.per_node, wide.nodes) == (16, 8, 2)
    small = ParallelLayout(tp=2)
    assert (small.per_node, small.nodes) == (2, 1)
    with pytest.raises(ValidationError, match="does not divide"):
        ParallelLayout(tp=4, pp=3, gpus_per_node=8)


def test_the_layout_of_a_gpu_type_else_the_any_one() -> None:
    entry = ModelEntry.model_validate(
        {"layouts": {"h100": {"tp": 8, "pp": 2}, "any": {"tp": 4, "pp": 4}}}
    )
    assert entry.layout("h100") == ParallelLayout(tp=8, pp=2)
    assert entry.layout("a100") == ParallelLayout(tp=4, pp=4)
    assert entry.layout(None) == ParallelLayout(tp=4, pp=4)
    assert ModelEntry().layout("h100") is None
    with pytest.raises(ValidationError):
        ModelEntry.model_validate({"layouts": {"h100": {"tp": 8, "tensor": 2}}})


def test_the_engine_is_told_its_parallel_sizes() -> None:
    assert layout_engine_args(ParallelLayout(tp=8, pp=2)) == (
        "--tensor-parallel-size=8", "--pipeline-parallel-size=2",
    )  # fmt: skip
    assert layout_engine_args(ParallelLayout(tp=2, dp=2, expert_parallel=True))[2:] == (
        "--data-parallel-size=2", "--enable-expert-parallel",
    )  # fmt: skip


def test_admission_checks_the_layout_against_the_partition_s_nodes() -> None:
    layout = ParallelLayout(tp=8, pp=2)
    two = [node("n1", 8), node("n2", 8)]
    assert layout_problems(layout, two, "h100", "gpu") == []
    (few,) = layout_problems(layout, [node("n1", 8), node("n2", 4)], "h100", "gpu")
    assert few == ("layout tp=8 pp=2 needs 2 node(s) with 8 h100 GPU(s) each in partition "
                   "'gpu': 1 have that many (the largest has 8)")  # fmt: skip
    (down,) = layout_problems(layout, [node("n1", 8), node("n2", 8, state="DOWN")], "h100", None)
    assert down.endswith("1 usable (and 1 down or drained)")
    (typed,) = layout_problems(layout, [node("n1", 8, "a100"), node("n2", 8, "a100")], "h100", None)
    assert "0 have that many (the largest has 0)" in typed


def test_a_served_catalog_model_is_admitted_only_where_its_layout_fits() -> None:
    """Before anything is submitted: the catalog's layout for the request's GPU type against
    the partition's nodes, every problem named at once."""
    from xhpc.broker.admit.admission import admission_problems
    from xhpc.models import EngineKind, ServeRequest
    from xhpc.settings import XhpcConfig

    config = XhpcConfig.model_validate(
        {"models": {"big": {"path": "/m/big", "layouts": {"any": {"tp": 4, "pp": 2}}},
                    "huge": {"path": "/m/huge", "layouts": {"h100": {"tp": 8, "pp": 2}}}}}
    )  # fmt: skip
    nodes = [node("n1", 4, None), node("n2", 4, None), node("n3", 4, None)]
    assert admission_problems(ServeRequest(model="big"), nodes, config, EngineKind.VLLM) == []
    problems = admission_problems(ServeRequest(model="big"), nodes[:1], config, EngineKind.VLLM)
    assert any("layout tp=4 pp=2 needs 2 node(s) with 4 GPU(s) each" in p for p in problems)
    h100 = [node("n1", 8), node("n2", 4)]
    problems = admission_problems(
        ServeRequest(model="huge", gpu_type="h100"), h100, config, EngineKind.VLLM
    )
    assert any("needs 2 node(s) with 8 h100 GPU(s)" in p for p in problems), problems
