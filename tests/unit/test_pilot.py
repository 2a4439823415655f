"""Pilot allocations: in-job device picking (pure), admission into a pilot, a pilot's orders,
and the broker's pilot flow with real SQLite and a recording Slurm stand-in."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from tests.unit.test_broker_service import RecordingSlurm, make
from xhpc.agent.slots import DeviceTable, SlotError, allocate_devices
from xhpc.broker.desks import pilot_desk
from xhpc.broker.desks.agents import Verdict
from xhpc.broker.plan.pilots import pilot_orders, pilot_problems, pinned_to_pilot
from xhpc.clock import utcnow
from xhpc.errors import AdmissionError
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    JobInfo,
    NodeInfo,
    PilotReport,
    PilotState,
    ReplicaConfig,
    ReplicaView,
    ScalingPolicy,
    ServeRequest,
)
from xhpc.records import PilotRecord
from xhpc.settings import LifecycleConfig
from xhpc.store import ReplicaRow, replica_record

# -- in-job device picking ----------------------------------------------------------------------


def test_idle_first_prefers_unheld_then_less_memory_then_lower_index() -> None:
    table = DeviceTable(devices=(0, 1, 2, 3), mem_used_mb={0: 500.0, 1: 0.0, 2: 0.0, 3: 10.0})
    assert allocate_devices(table, "r0", 2) == (1, 2)
    held = table.with_held("r0", (1, 2))
    assert allocate_devices(held, "r1", 1) == (3,)  # 3 uses less memory than 0
    assert table.held == {}  # never mutated


def test_sharing_off_refuses_with_no_available_slot() -> None:
    table = DeviceTable(devices=(0, 1)).with_held("a", (0,)).with_held("b", (1,))
    with pytest.raises(SlotError, match="No available slot for replica c: it needs 1 GPU"):
        allocate_devices(table, "c", 1)
    # With sharing on, the least-held GPU is shared instead.
    assert allocate_devices(table.with_held("d", (0,)), "c", 1, sharing=True) == (1,)


def test_pins_are_honoured_and_checked_against_the_allocation() -> None:
    table = DeviceTable(devices=(2, 3))
    assert allocate_devices(table, "r", 1, (3,)) == (3,)
    with pytest.raises(SlotError, match=r"pinned GPU\(s\) 0 of replica r are not in this pilot"):
        allocate_devices(table, "r", 1, (0,))
    with pytest.raises(SlotError, match=r"No available slot: replica s is pinned .*GPU 3 by r"):
        allocate_devices(table.with_held("r", (3,)), "s", 1, (3,))
    assert allocate_devices(table.with_held("r", (3,)), "s", 1, (3,), sharing=True) == (3,)
    with pytest.raises(SlotError, match="pins 1 GPU"):
        allocate_devices(table, "r", 2, (3,))


def test_freed_gpus_are_offered_again() -> None:
    table = DeviceTable(devices=(0, 1)).with_held("a", (0,)).with_held("b", (1,))
    assert allocate_devices(table.without("a"), "c", 1) == (0,)


# -- admission into a pilot ---------------------------------------------------------------------


def _node(gpus: int = 4) -> NodeInfo:
    return NodeInfo(name="n1", address="10.0.0.1", state="IDLE", partitions=("gpu",),
                    gpus_total=gpus)  # fmt: skip


def _pilot(gpus: int) -> PilotRecord:
    now = utcnow()
    return PilotRecord(pilot_id="pilot-1", node="n1", gpus=gpus, state=PilotState.RUNNING,
                       job_id="7", token_hash="x", pilot_dir="/tmp/p", created_at=now,
                       updated_at=now)  # fmt: skip


def test_pinned_to_pilot_targets_the_pilots_node() -> None:
    req = ServeRequest(model="m", replicas=2, pilot="n1",
                       replica_configs=(ReplicaConfig(gpu_idx=(1,)), ReplicaConfig()))  # fmt: skip
    assert [t.node for t in pinned_to_pilot(req).replica_configs] == ["n1", "n1"]
    assert pinned_to_pilot(ServeRequest(model="m")) == ServeRequest(model="m")


def test_pilot_problems_are_all_named() -> None:
    req = ServeRequest(model="m", replicas=3, gpus=1, pilot="n1", pilot_gpus=2, nodelist="n2",
                       let_slurm_place=True)  # fmt: skip
    problems = pilot_problems(req, _node(), None, gpu_sharing=False)
    assert any("--pilot and --nodelist" in p for p in problems)
    assert any("--let-slurm-place" in p for p in problems)
    assert any("No available slot: 3 GPUs asked for" in p and "holds 2" in p for p in problems)
    assert pilot_problems(req.model_copy(update={"nodelist": None, "let_slurm_place": False}),
                          _node(), None, gpu_sharing=True) == []  # fmt: skip
    big = ServeRequest(model="m", pilot="n1", pilot_gpus=8)
    assert pilot_problems(big, _node(), None, gpu_sharing=False) == [
        "--pilot-gpus 8: node n1 has 4 GPUs"
    ]
    assert "holds 4 GPUs, not --pilot-gpus 2" in pilot_problems(
        ServeRequest(model="m", pilot="n1", pilot_gpus=2), _node(), _pilot(4),
        gpu_sharing=False,
    )[0]  # fmt: skip


# -- a pilot's orders ---------------------------------------------------------------------------


def _row(rid: str, state: str, pinned: str = "") -> ReplicaView:
    now = utcnow()
    return replica_record(ReplicaRow(replica_id=rid, deployment="m", idx=0, state=state,
                                   engine="vllm", replica_dir=f"/s/{rid}", pinned=pinned,
                                   gpus_asked=2, pilot_id="pilot-1", created_at=now,
                                   updated_at=now))  # fmt: skip


def test_orders_run_wanted_replicas_and_stop_the_rest_after_their_drain() -> None:
    rows = [_row("a", "READY"), _row("b", "QUEUED", "3"), _row("c", "DRAINING"),
            _row("d", "STOPPED"), _row("e", "CREATING")]  # fmt: skip
    report = PilotReport(pilot_id="pilot-1", job_id="7", node="n1", devices=(0, 1, 2, 3),
                         running={"a": (0, 1), "c": (2,), "d": (3,), "x": ()})  # fmt: skip
    orders = pilot_orders(report, rows, released=())
    assert [(a.replica_id, a.gpus, a.gpu_idx) for a in orders.run] == [
        ("a", 2, ()),
        ("b", 1, (3,)),
    ]
    assert orders.stop == ("d", "x")  # c drains first: proxies may still use it
    assert pilot_orders(report, rows, released={"c"}).stop == ("c", "d", "x")


# -- the broker's pilot flow --------------------------------------------------------------------


class PilotSlurm(RecordingSlurm):
    """sbatch of a pilot script: its directory is the pilot's, not a replica's."""

    scripts: list[str]

    async def submit(self, script: Path) -> str:
        if script.parent.parent.name == "pilots":
            self.submitted.append(str(100 + len(self.submitted)))
            self.scripts = [*getattr(self, "scripts", []), script.read_text()]
            return self.submitted[-1]
        return await super().submit(script)


async def test_serve_into_a_pilot_then_stop_cancels_the_empty_pilot(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=PilotSlurm)
    assert isinstance(slurm, PilotSlurm)
    req = ServeRequest(model=str(model_dir), replicas=2, pilot="n2", gpu_type=None)
    dep = await service.serve(req)
    assert slurm.submitted == ["100"]  # one job: the pilot
    (script,) = slurm.scripts
    assert "--nodelist=n2" in script and "--gres=gpu:4" in script and "--pilot" in script
    assert "--comment=xhpc-pilot:" in script
    assert [(r.state.value, r.job_id) for r in dep.replicas] == [("QUEUED", "100")] * 2
    assert not (Path(str(service.store.replica("m-0").replica_dir)) / "job.sbatch").exists()
    # A second deployment joins the running pilot: no new job.
    await service.serve(ServeRequest(model=str(model_dir), name="m2", pilot="n2"))
    assert slurm.submitted == ["100"]
    (pilot,) = service.pilot_desk.pilots.live()
    token = (Path(pilot.pilot_dir) / "token").read_text()
    report = PilotReport(pilot_id=pilot.pilot_id, job_id="100", node="n2", devices=(0, 1, 2, 3))
    with pytest.raises(PermissionError):
        service.pilot_desk.heartbeat(token + "x", report)
    with pytest.raises(PermissionError):
        service.pilot_desk.heartbeat(token, report.model_copy(update={"job_id": "999"}))
    orders = service.pilot_desk.heartbeat(token, report)
    assert [a.replica_id for a in orders.run] == ["m-0", "m-1", "m2-0"]
    assert service.pilot_desk.pilots.get(pilot.pilot_id).state == "RUNNING"
    # Stopping a replica in a pilot cancels no job: the pilot stops it.
    running = report.model_copy(update={"running": {"m-0": (0,), "m-1": (1,), "m2-0": (2,)}})
    await service.stop("m-0")
    assert slurm.cancelled == []
    assert service.pilot_desk.heartbeat(token, running).stop == ("m-0",)
    service.agents.report(AgentReport(replica_id="m-0", job_id="100", phase="stopped"))
    assert service.store.replica("m-0").state == "STOPPED"
    # No replica left: the next reconcile cancels the pilot's job.
    await service.stop("m")
    await service.stop("m2")
    for rid in ("m-1", "m2-0"):
        service.agents.report(AgentReport(replica_id=rid, job_id="100", phase="stopped"))
    slurm.queue = [JobInfo(job_id="100", raw_job_id=100, name="p", state="RUNNING")]
    await service.reconcile_once()
    assert slurm.cancelled == ["100"]
    assert service.pilot_desk.pilots.live() == []


async def test_admission_refuses_what_no_pilot_can_hold(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    req = ServeRequest(model=str(model_dir), replicas=3, gpus=2, pilot="n1")
    with pytest.raises(AdmissionError) as err:
        await service.serve(req)
    assert any("No available slot: 6 GPUs asked for" in p for p in err.value.problems)
    assert slurm.submitted == [] and service.pilot_desk.pilots.not_ended() == []


async def test_scale_up_remembers_the_gpu_type_and_the_pilot(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=PilotSlurm)
    assert isinstance(slurm, PilotSlurm)
    await service.serve(ServeRequest(model=str(model_dir), pilot="n1", pilot_gpus=2))
    result = await service.scale("m", 2)
    assert result.added == ("m-1",)
    assert service.store.replica("m-1").pilot == service.store.replica("m-0").pilot
    assert slurm.submitted == ["100"]
    dep = service.store.get_deployment("m")
    assert (dep.pilot_node, dep.gpu_type) == ("n1", None)
    assert utcnow() - dep.created_at.replace(tzinfo=utcnow().tzinfo) < timedelta(minutes=1)


async def test_a_pilots_replica_hands_over_to_a_new_pilot_and_a_requeued_pilot_waits(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=PilotSlurm)
    assert isinstance(slurm, PilotSlurm)
    service.config = service.config.model_copy(
        update={"lifecycle": LifecycleConfig(backoff_s=0, restart_grace_s=0, handover_floor_s=300)}
    )
    await service.serve(ServeRequest(model=str(model_dir), pilot="n1", pilot_gpus=1))
    (first,) = service.pilot_desk.pilots.live()
    start = utcnow() - timedelta(minutes=8)
    slurm.queue = [
        JobInfo(
            job_id="100",
            raw_job_id=100,
            name="p",
            state="RUNNING",
            batch_host="n1",
            start_time=start,
            time_limit_min=10,
        )
    ]
    await service.reconcile_once()
    reg = AgentRegistration(
        replica_id="m-0", job_id="100", node="n1", host="10.0.0.1", port=9000, served_model="m"
    )
    service.agents.register(reg)
    await service.reconcile_once()  # 2 minutes left < 300 s: a successor, in a new pilot
    assert slurm.submitted == ["100", "101"]
    successor = service.store.replica("m-1")
    assert successor.successor_of == "m-0" and successor.pilot != first.pilot_id
    assert successor.job_id == "101"
    # The old pilot's job is requeued (its node failed): the pilot waits PENDING with it.
    slurm.queue = [msgspec.structs.replace(slurm.queue[0], state="PENDING")]
    await service.reconcile_once()
    assert service.pilot_desk.pilots.get(first.pilot_id).state == "PENDING"
    assert service.store.replica("m-0").state == "QUEUED"


async def test_a_pilot_stopping_on_its_own_takes_its_replicas_out_of_routing_only(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    """SIGTERM or the time-limit warning reached the pilot (an end, or a requeue): the replicas
    it stopped leave the routing table; the pilot job's fate decides their state, and an
    earlier run of a requeued pilot is not listened to."""
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=PilotSlurm)
    await service.serve(ServeRequest(model=str(model_dir), pilot="n1", pilot_gpus=1))
    slurm.queue = [JobInfo(job_id="100", raw_job_id=100, name="p", state="RUNNING")]
    await service.reconcile_once()
    reg = AgentRegistration(
        replica_id="m-0", job_id="100", node="n1", host="10.0.0.1", port=9000, served_model="m"
    )
    service.agents.register(reg)
    stopped = AgentReport(replica_id="m-0", job_id="100", phase="stopped")
    service.agents.report(stopped)
    row = service.store.replica("m-0")
    assert (row.state, row.host) == ("READY", None)
    assert service.routes().routes == ()
    slurm.queue = [JobInfo(job_id="100", raw_job_id=100, name="p", state="PENDING")]
    await service.reconcile_once()  # requeued: waiting for the pilot's next run
    assert service.store.replica("m-0").state == "QUEUED"
    assert service.agents.report(stopped) is Verdict.GONE  # the old run, late
    assert service.store.replica("m-0").state == "QUEUED"


async def test_an_empty_pilot_is_kept_warm_for_an_asleep_deployment_whose_wake_starts_in_it(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``[autoscale] pilot_warm_s``, a pilot left empty by an autoscaled deployment that
    went to sleep stays up that long: the wake starts in it (no new job); past it, cancelled."""
    now = [1000.0]
    monkeypatch.setattr(pilot_desk, "monotonic", lambda: now[0])
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=PilotSlurm)
    service.pilot_desk.warm_s = 60.0
    policy = ScalingPolicy(min_replicas=0, max_replicas=1)
    await service.serve(ServeRequest(model=str(model_dir), pilot="n2", scaling=policy))
    (pilot,) = service.pilot_desk.pilots.live()
    token = (Path(pilot.pilot_dir) / "token").read_text()
    report = PilotReport(pilot_id=pilot.pilot_id, job_id="100", node="n2", devices=(0, 1, 2, 3))
    service.pilot_desk.heartbeat(token, report)
    slurm.queue = [JobInfo(job_id="100", raw_job_id=100, name="p", state="RUNNING")]

    async def sleep_now() -> None:
        await service.scale("m", 0)  # the autoscaler's own call: asleep by its policy
        for row in service.store.replicas(deployment="m", active_only=True):
            service.agents.report(AgentReport(replica_id=row.replica_id, job_id="100",
                                              phase="stopped"))  # fmt: skip
        assert service.store.get_deployment("m").sleeping
        await service.reconcile_once()

    await sleep_now()
    assert slurm.cancelled == []  # kept warm
    result = await service.scale("m", 1)  # the wake: into the warm pilot, no new job
    assert slurm.submitted == ["100"]
    assert service.store.replica(result.added[0]).pilot == pilot.pilot_id
    await sleep_now()
    now[0] += 59
    await service.reconcile_once()
    assert slurm.cancelled == []
    now[0] += 2  # empty for longer than pilot_warm_s
    await service.reconcile_once()
    assert slurm.cancelled == ["100"]
