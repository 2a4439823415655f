"""What `xhpc ps` and `xhpc serve`'s progress say of a queued replica (Slurm's pending reason,
its start estimate) and of a running one (its job's time left)."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

from rich.console import Console

from xhpc.cli.deploy.serve import progress_table
from xhpc.cli.observe.ps import replica_table
from xhpc.dashboard.spans import coming
from xhpc.models import DeploymentView, EngineKind, ReplicaOutlook, ReplicaState, ReplicaView

NOW = datetime(2026, 12, 1, 13, 51, 22, tzinfo=UTC)
SOON = NOW + timedelta(minutes=12, seconds=5)


def text(table: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(table)
    return out.getvalue()


def test_a_queued_replica_shows_its_start_estimate_or_that_there_is_none_yet() -> None:
    assert coming("QUEUED", SOON, None, NOW) == "starts in 12m05s at 14:03:27 UTC"
    assert coming("QUEUED", None, None, NOW) == "start not estimated yet"
    assert coming("QUEUED", NOW - timedelta(seconds=1), None, NOW) == "start due (13:51:21 UTC)"


def test_a_running_replica_shows_its_time_left_and_others_nothing() -> None:
    assert coming("READY", None, 2700.0, NOW) == "45m00s left"
    assert coming("STARTING", None, 59.0, NOW) == "59s left"
    assert coming("READY", None, None, NOW) == "-"  # no time limit
    assert coming("CREATING", None, None, NOW) == "-"


def _view(state: ReplicaState, reason: str | None, outlook: ReplicaOutlook) -> ReplicaView:
    return ReplicaView(
        replica_id="m-0", deployment="m", index=0, state=state, engine=EngineKind.COMMAND,
        job_id="7", reason=reason, created_at=NOW, updated_at=NOW, outlook=outlook,
    )  # fmt: skip


def test_serve_progress_shows_the_pending_reason_and_the_estimate() -> None:
    out = ReplicaOutlook(replica_id="m-0", pending_reason="Resources", start_estimate=SOON)
    dep = DeploymentView(
        name="m", model="m", model_path="/m", engine=EngineKind.COMMAND, gpus=1,
        replicas=(_view(ReplicaState.QUEUED, "submitted", out),),
    )  # fmt: skip
    shown = text(progress_table(dep, {"m-0"}, NOW))
    assert "starts in 12m05s at 14:03:27 UTC" in shown
    assert "submitted (Slurm: Resources)" in shown


def test_ps_reads_the_same_fields_from_the_raw_answer() -> None:
    out = ReplicaOutlook(replica_id="m-0", pending_reason="Priority", start_estimate=SOON)
    row = _view(ReplicaState.QUEUED, None, out).model_dump(mode="json")
    shown = text(replica_table([row], NOW))
    assert "starts in 12m05s at 14:03:27 UTC" in shown and "Slurm: Priority" in shown
    running = ReplicaOutlook(replica_id="m-0", time_left_s=3600.0)
    row = _view(ReplicaState.READY, "engine answered", running).model_dump(mode="json")
    assert "1h00m left" in text(replica_table([row], NOW))
    row.pop("outlook")  # an older broker: no outlook at all
    assert "engine answered" in text(replica_table([row], NOW))
