"""Queue estimates: sbatch --test-only's answer parsed, and the node a replica that fits nowhere
now queues on (the earliest estimate, bounded candidates, failures left out)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from xhpc.broker.plan.queue_estimates import ask, choose
from xhpc.errors import SlurmError, SlurmParseError
from xhpc.models import NodeInfo, StartEstimate
from xhpc.placement import PlacementRequest, build_snapshot
from xhpc.placement.waiting import Candidate, earliest, queue_candidates, spread, waiting_reason
from xhpc.settings import PlacementConfig
from xhpc.slurm.argv import sbatch_test_only
from xhpc.slurm.estimate import parse_test_only

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "slurm" / "sbatch-test-only.txt"
AT = datetime(2026, 12, 1, 14, 3, 27, tzinfo=UTC)


def _blocks() -> list[str]:
    """The sample's outputs, one per block of non-comment lines."""
    blocks: list[list[str]] = [[]]
    for line in SAMPLE.read_text().splitlines():
        if line.startswith("#"):
            if blocks[-1]:
                blocks.append([])
            continue
        blocks[-1].append(line)
    return ["\n".join(b) + "\n" for b in blocks if b]


def test_the_start_is_read_from_epoch_seconds_as_utc() -> None:
    est = parse_test_only(_blocks()[0])
    assert est == StartEstimate(
        start=datetime.fromtimestamp(1796133807, UTC), partition="gpu", nodes="n2", processors=2
    )
    assert est.start.tzinfo is UTC


def test_slurms_default_time_format_is_read_as_local_time() -> None:
    est = parse_test_only(_blocks()[1])
    assert est.start == datetime(2026, 12, 1, 14, 3, 27).astimezone().astimezone(UTC)
    assert est.start.tzinfo is not None


def test_other_lines_are_skipped_and_the_partition_may_be_missing() -> None:
    est = parse_test_only(_blocks()[2])
    assert est.partition is None and est.nodes == "n[1-2]" and est.processors == 8


@pytest.mark.parametrize(
    "text",
    [
        "",
        "sbatch: error: Batch job submission failed: Requested node configuration is not "
        "available\n",
        "sbatch: Job 1 to start at soon using 2 processors on nodes n1 in partition gpu\n",
        "sbatch: Job x to start at 1 using 2 processors on nodes n1\n",
        "sbatch: Job 1 to start at 1 using 2 processors on nodes n1 in partition gpu; rm -rf\n",
        "sbatch: Job 1 to start at " + "9" * 5000 + " using 2 processors on nodes n1\n",
    ],
)
def test_odd_or_failed_answers_are_parse_errors(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_test_only(text)


def test_the_argv_asks_about_one_node_and_submits_nothing() -> None:
    argv = sbatch_test_only(["--gres=gpu:2", "--time=01:00:00"], "gpu", "n2")
    assert argv == [
        "sbatch", "--test-only", "--gres=gpu:2", "--time=01:00:00", "--nodelist=n2",
        "--partition=gpu", "--wrap=true",
    ]  # fmt: skip
    assert "--partition" not in " ".join(sbatch_test_only([], None, "n2"))


def _nodes(free: dict[str, int], total: int = 4) -> list[NodeInfo]:
    return [
        NodeInfo(
            name=n, address=n, state="MIXED", partitions=("gpu",), gpus_total=total,
            gpus_used=total - f, gpus_used_idx=tuple(range(total - f)), cpus=8,
        )
        for n, f in free.items()
    ]  # fmt: skip


def _snapshot(free: dict[str, int], total: int = 4):  # type: ignore[no-untyped-def]
    return build_snapshot(_nodes(free, total), [], [], [], now=AT)


def test_candidates_are_bounded_and_only_nodes_that_could_ever_hold_the_job() -> None:
    snap = _snapshot({"n1": 0, "n2": 0, "n3": 0, "n4": 0})
    req = PlacementRequest(gpus=2, partition="gpu")
    assert [c.node for c in queue_candidates(snap, req, 2)] == ["n1", "n2"]
    assert queue_candidates(snap, req, 0) == []
    assert queue_candidates(snap, req.model_copy(update={"gpus": 8}), 4) == []
    assert queue_candidates(snap, req.model_copy(update={"partition": "cpu"}), 4) == []
    listed = req.model_copy(update={"nodes": ("n3",)})
    assert queue_candidates(snap, listed, 4) == [Candidate("n3", "gpu")]


def test_the_earliest_estimate_wins_and_ties_keep_the_idle_first_order() -> None:
    cands = [Candidate("n1", "gpu"), Candidate("n2", "gpu"), Candidate("n3", "gpu")]
    est = {
        cands[0]: StartEstimate(start=AT + timedelta(hours=1)),
        cands[1]: StartEstimate(start=AT),
        cands[2]: StartEstimate(start=AT),
    }
    ranked = earliest(cands, est)
    assert [c.node for c, _ in ranked] == ["n2", "n3", "n1"]
    assert [c.node for c in spread(ranked, 4)] == ["n2", "n3", "n1", "n2"]
    assert earliest(cands, {}) == [] and spread([], 2) == []
    assert waiting_reason(cands[1], est[cands[1]]) == (
        "nothing idle; n2 in gpu expected to start first at 14:03:27 UTC"
    )


class FakeEstimates:
    """sbatch --test-only per node: a start, an error, or a call that never answers."""

    def __init__(self, answers: dict[str, datetime | str]) -> None:
        self.answers = answers
        self.asked: list[str] = []
        self.cancelled: list[str] = []

    async def estimate_start(
        self, options: Sequence[str], partition: str | None, node: str
    ) -> StartEstimate:
        self.asked.append(node)
        answer = self.answers[node]
        if answer == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.append(node)
                raise
        if isinstance(answer, str):
            raise SlurmError("sbatch --test-only failed", argv=["sbatch"], returncode=1)
        return StartEstimate(start=answer, partition=partition, nodes=node)


async def test_failed_and_slow_estimates_are_left_out_within_the_time_bound() -> None:
    slurm = FakeEstimates({"n1": "hang", "n2": "error", "n3": AT + timedelta(minutes=5)})
    cands = [Candidate("n1", "gpu"), Candidate("n2", "gpu"), Candidate("n3", "gpu")]
    got = await ask(slurm, cands, ["--gres=gpu:4"], timeout_s=0.2)  # type: ignore[arg-type]
    assert list(got) == [Candidate("n3", "gpu")] and slurm.cancelled == ["n1"]


async def test_choose_queues_on_the_earliest_and_says_why() -> None:
    slurm = FakeEstimates({"n1": AT + timedelta(hours=2), "n2": AT, "n3": "error"})
    snap = _snapshot({"n1": 0, "n2": 0, "n3": 0})
    req = PlacementRequest(gpus=4, partition="gpu")
    config = PlacementConfig(estimate_candidates=3)
    choice = await choose(slurm, snap, req, 2, [], config)  # type: ignore[arg-type]
    assert choice.nodes == ("n2", "n1")
    assert choice.reasons[0] == "nothing idle; n2 in gpu expected to start first at 14:03:27 UTC"
    none = await choose(
        FakeEstimates({n: "error" for n in ("n1", "n2", "n3")}), snap, req, 1, [], config
    )  # type: ignore[arg-type]
    assert none.nodes == (None,) and none.reasons == (None,)
