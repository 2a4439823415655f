"""``Client``: the broker's control API, each call typed with xhpc's models, and the waits a
caller needs (a deployment READY and routed by every proxy, replicas stopped, a scale settled).

The CLI's commands and the Python API are built on it; errors are xhpc's (``xhpc.errors``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from xhpc.client.http import BrokerTransport
from xhpc.errors import NotFoundError, ValidationError, XhpcError, plain_message
from xhpc.ids import Id, IdKind, control_path, valid
from xhpc.models import (
    DeploymentView,
    LogsView,
    PilotView,
    ReplicaState,
    ReplicaView,
    ScaleResult,
    ScalingChange,
    ServeRequest,
)
from xhpc.paths import (
    broker_file_path_in,
    control_socket_path_in,
    control_token_path_in,
    reachable_socket,
)
from xhpc.peers import listening
from xhpc.states import TERMINAL
from xhpc.wire import read, read_list, request_json

if TYPE_CHECKING:  # the models of the commands that use them, imported by those only
    from xhpc.access import KeyCreate, KeyCreated, KeyView, UsageLine
    from xhpc.batch.spec import BatchRequest, BatchView
    from xhpc.dashboard.overview import Overview
    from xhpc.orphans import OrphanFixRequest, OrphanFixResult, OrphanReport
    from xhpc.placement.views import SnapshotView
    from xhpc.records import AdapterAdd, AdapterRecord, AdapterView
    from xhpc.weights import (
        CacheCopy,
        CacheOutcome,
        CachePrune,
        CachePull,
        CacheRemove,
        PullView,
    )

S = ReplicaState
# A replica in one of these will not become READY by waiting.
GONE = frozenset({S.FAILED, S.STOPPED, S.LOST})
POLL_S = 0.1  # how often a wait asks the broker again (a local socket: ~1 ms an answer)

_replicas = TypeAdapter(list[ReplicaView])
_deployments = TypeAdapter(list[DeploymentView])
_pilots = TypeAdapter(list[PilotView])


M = TypeVar("M", bound=BaseModel)


def request_of(cls: type[M], fields: dict[str, object], spell: Callable[[str], str]) -> M:
    """A request model from a caller's values; the first problem as one ValidationError that
    names the field as the caller wrote it (``spell``: a CLI flag, a keyword argument)."""
    try:
        return cls.model_validate(fields)
    except PydanticValidationError as err:
        first = err.errors()[0]
        name = spell(".".join(str(p) for p in first["loc"]))
        limits = first.get("ctx") or {}
        if first["type"] == "greater_than_equal":
            msg = f"{name} must be at least {limits.get('ge')}"
        elif first["type"] == "less_than_equal":
            msg = f"{name} must be at most {limits.get('le')}"
        else:
            msg = f"{name}: {plain_message(first['msg'])}"
        raise ValidationError(msg) from err


def _id(kind: IdKind, value: str, what: str) -> Id:
    """``value`` as one segment of a control path: NotFoundError (no such ``what``) when it
    fails ``kind``'s rule, before any call."""
    if not valid(kind, value):
        shown = value if value.isprintable() and len(value) <= 80 else repr(value[:80])
        raise NotFoundError(f"no {what} {shown!r}")
    return Id(kind, value)


def _acting() -> dict[str, str]:
    """The header naming who a call to the Batch API acts for: this process's own user (the
    broker refuses a call of the proxy's identity that names no one)."""
    from xhpc.access import ACTING_USER_HEADER
    from xhpc.peers import user_name

    return {ACTING_USER_HEADER: user_name(os.getuid())}


class Client:
    """One user's broker, reached on its control socket."""

    def __init__(self, socket_path: Path, timeout_s: float = 120.0) -> None:
        self.transport = BrokerTransport(socket_path, timeout_s)

    @classmethod
    def over(cls, transport: BrokerTransport) -> Client:
        """A client on a transport of the caller's (a test's stand-in broker)."""
        client = cls.__new__(cls)
        client.transport = transport
        return client

    @classmethod
    def of_state_dir(cls, state_dir: Path, timeout_s: float = 120.0) -> Client:
        """The broker of ``state_dir``: on its unix socket when this host reaches it; else (a
        job on a compute node) on its control API over TCP, at the address in its broker.json
        with the token in control.token (both in the state directory, which jobs see)."""
        client = cls(control_socket_path_in(state_dir), timeout_s)
        if listening(reachable_socket(client.transport.socket_path)):
            return client
        try:
            url = str(json.loads(broker_file_path_in(state_dir).read_text())["control_url"])
            token = control_token_path_in(state_dir).read_text().strip()
        except (OSError, ValueError, KeyError, TypeError):
            return client  # not running: its first call says so
        client.transport = BrokerTransport.over_tcp(url, token, client.socket_path, timeout_s)
        return client

    @property
    def socket_path(self) -> Path:
        return self.transport.socket_path

    def alive(self) -> bool:
        return self.transport.alive()

    # -- deployments ------------------------------------------------------------------------
    def serve(self, req: ServeRequest) -> DeploymentView:
        """Admit, place and submit; the deployment as it is right after ``sbatch``."""
        return read(DeploymentView, self.transport.post("/v1/serve", request_json(req)))

    def plan(self, req: ServeRequest) -> dict[str, str]:
        """The sbatch script of each replica (or unit) ``serve`` would submit; nothing is."""
        planned = self.transport.post("/v1/serve?dry_run=1", request_json(req))
        return {str(k): str(v) for k, v in dict(planned["scripts"]).items()}

    def deployment(self, name: str) -> DeploymentView:
        path = control_path("v1", "deployments", _id(IdKind.NAME, name, "deployment"))
        return read(DeploymentView, self.transport.get(path))

    def deployments(self) -> list[DeploymentView]:
        return read_list(_deployments, self.transport.get("/v1/deployments"))

    def replicas(self, all_: bool = False) -> list[ReplicaView]:
        return read_list(_replicas, self.transport.get(f"/v1/replicas?all={int(all_)}"))

    def stop(self, target: str) -> list[ReplicaView]:
        """Stop a deployment or one replica; its replicas as the stop left them."""
        rows = self.transport.post("/v1/stop", json.dumps({"target": target}))
        return read_list(_replicas, rows)

    def scale(self, name: str, replicas: int) -> ScaleResult:
        body = json.dumps({"name": name, "replicas": replicas})
        return read(ScaleResult, self.transport.post("/v1/scale", body))

    def change_scaling(self, name: str, change: ScalingChange) -> DeploymentView:
        """Change deployment ``name``'s scaling policy in place: the knobs ``change`` gives."""
        path = control_path("v1", "deployments", _id(IdKind.NAME, name, "deployment"), "scaling")
        answer = self.transport.post(path, change.model_dump_json(exclude_none=True))
        return read(DeploymentView, answer)

    def logs(self, replica_id: str, lines: int = 200) -> LogsView:
        replica = _id(IdKind.NAME, replica_id, "replica")
        path = control_path("v1", "replicas", replica, "logs", query={"lines": int(lines)})
        return read(LogsView, self.transport.get(path))

    # -- the cluster, keys, pilots, orphans --------------------------------------------------
    def nodes(self) -> SnapshotView:
        from xhpc.placement.views import SnapshotView

        return read(SnapshotView, self.transport.get("/v1/nodes"))

    def overview(self, events: int = 20) -> Overview:
        """Nodes, deployments and their replicas, proxy load and the last ``events`` events, in
        one answer from the broker's shared Slurm view (`xhpc top`)."""
        from xhpc.dashboard.overview import Overview

        return read(Overview, self.transport.get(f"/v1/overview?events={int(events)}"))

    def pilots(self) -> list[PilotView]:
        return read_list(_pilots, self.transport.get("/v1/pilots"))

    def create_key(self, req: KeyCreate) -> KeyCreated:
        from xhpc.access import KeyCreated

        return read(KeyCreated, self.transport.post("/v1/keys", request_json(req)))

    def keys(self) -> list[KeyView]:
        from xhpc.access import KeyView

        return read_list(TypeAdapter(list[KeyView]), self.transport.get("/v1/keys"))

    def revoke_key(self, key_id: str) -> KeyView:
        from xhpc.access import KeyView

        path = control_path("v1", "keys", _id(IdKind.KEY, key_id, "key"), "revoke")
        return read(KeyView, self.transport.post(path, "{}"))

    def usage(self) -> list[UsageLine]:
        from xhpc.access import UsageLine

        return read_list(TypeAdapter(list[UsageLine]), self.transport.get("/v1/usage"))

    def orphans(self) -> OrphanReport:
        from xhpc.orphans import OrphanReport

        return read(OrphanReport, self.transport.get("/v1/orphans"))

    def fix_orphans(self, req: OrphanFixRequest) -> OrphanFixResult:
        from xhpc.orphans import OrphanFixResult

        answer = self.transport.post("/v1/orphans/fix", request_json(req))
        return read(OrphanFixResult, answer)

    # -- the weights cache ---------------------------------------------------------------------
    def add_adapter(self, req: AdapterAdd) -> AdapterRecord:
        from xhpc.records import AdapterRecord

        return read(AdapterRecord, self.transport.post("/v1/adapters", request_json(req)))

    def adapters(self) -> list[AdapterView]:
        from xhpc.records import AdapterView

        return read_list(TypeAdapter(list[AdapterView]), self.transport.get("/v1/adapters"))

    def remove_adapter(self, name: str) -> AdapterRecord:
        from xhpc.records import AdapterRecord

        path = control_path("v1", "adapters", _id(IdKind.NAME, name, "adapter"), "rm")
        answer = self.transport.post(path, "{}")
        return read(AdapterRecord, answer)

    def cache_copies(self) -> list[CacheCopy]:
        from xhpc.weights import CacheCopy

        return read_list(TypeAdapter(list[CacheCopy]), self.transport.get("/v1/cache"))

    def cache_rm(self, req: CacheRemove) -> CacheOutcome:
        from xhpc.weights import CacheOutcome

        answer = self.transport.post("/v1/cache/rm", request_json(req))
        return read(CacheOutcome, answer)

    def cache_prune(self, req: CachePrune) -> CacheOutcome:
        from xhpc.weights import CacheOutcome

        answer = self.transport.post("/v1/cache/prune", request_json(req))
        return read(CacheOutcome, answer)

    def cache_pull(self, req: CachePull) -> PullView:
        """Submit the job that copies ``req.source`` into the shared store (admins)."""
        from xhpc.weights import PullView

        return read(PullView, self.transport.post("/v1/cache/pull", request_json(req)))

    def cache_pull_status(self, pull_id: str) -> PullView:
        from xhpc.weights import PullView

        path = control_path("v1", "cache", "pulls", _id(IdKind.PULL, pull_id, "pull"))
        return read(PullView, self.transport.get(path))

    # -- batches ----------------------------------------------------------------------------
    def upload_batch_input(self, path: Path) -> str:
        """Stream the JSONL file at ``path`` to the broker (``POST /v1/batch-inputs``, within
        its limits); the input's id, for ``BatchRequest.input_id``."""
        answer = self.transport.request(
            "POST", control_path("v1", "batch-inputs"), headers=_acting(), upload=path
        )
        return str(answer["id"])

    def create_batch(self, req: BatchRequest) -> BatchView:
        from xhpc.batch.spec import BatchView

        answer = self.transport.post("/v1/batches", request_json(req), _acting())
        return read(BatchView, answer)

    def batches(self) -> list[BatchView]:
        from xhpc.batch.spec import BatchView

        answer = self.transport.get("/v1/batches", _acting())
        return read_list(TypeAdapter(list[BatchView]), answer)

    def batch(self, batch_id: str) -> BatchView:
        from xhpc.batch.spec import BatchView

        path = control_path("v1", "batches", _id(IdKind.BATCH, batch_id, "batch"))
        return read(BatchView, self.transport.get(path, _acting()))

    def batch_output(self, batch_id: str, errors: bool = False) -> str:
        """The batch's output file (``errors``: its error file), JSONL, once it has ended."""
        batch = _id(IdKind.BATCH, batch_id, "batch")
        path = control_path("v1", "batches", batch, "output", query={"errors": int(errors)})
        return str(self.transport.get(path, _acting())["jsonl"])

    def wait_batch(self, batch_id: str, timeout_s: float, poll_s: float = 1.0) -> BatchView:
        """Until the batch has ended (completed, failed or cancelled); XhpcError after
        ``timeout_s`` (the batch keeps going)."""
        from xhpc.batch.spec import ENDED

        deadline = time.monotonic() + timeout_s
        while True:
            view = self.batch(batch_id)
            if view.status in ENDED:
                return view
            if time.monotonic() > deadline:
                counts = view.request_counts
                raise XhpcError(
                    f"batch {batch_id} is still {view.status.value} after {timeout_s:.0f}s "
                    f"({counts.completed + counts.failed} of {counts.total} lines answered)",
                    hint=f"xhpc batch status {batch_id}",
                )
            time.sleep(poll_s)

    def cancel_batch(self, batch_id: str) -> BatchView:
        from xhpc.batch.spec import BatchView

        path = control_path("v1", "batches", _id(IdKind.BATCH, batch_id, "batch"), "cancel")
        return read(BatchView, self.transport.post(path, "{}", _acting()))

    # -- waits ------------------------------------------------------------------------------
    def wait_ready(
        self,
        dep: DeploymentView,
        timeout_s: float,
        on_update: Callable[[DeploymentView], None] | None = None,
    ) -> DeploymentView:
        """Wait until every replica ``dep`` started with is READY and every proxy routes it
        (the first request through the proxy is answered). XhpcError when one of them fails,
        stops or is lost, or after ``timeout_s``; the deployment keeps going either way."""
        ids = {r.replica_id for r in dep.replicas if r.state not in GONE}
        deadline = time.monotonic() + timeout_s
        while True:
            states = [r.state for r in dep.replicas if r.replica_id in ids]
            ready = bool(states) and all(s is S.READY for s in states)
            if ready and dep.routed:
                return dep
            bad = [r for r in dep.replicas if r.replica_id in ids and r.state in GONE]
            if bad:
                raise XhpcError(
                    f"replica {bad[0].replica_id} is {bad[0].state.value}: {bad[0].reason or ''}",
                    hint=f"see `xhpc logs {bad[0].replica_id}`",
                )
            if time.monotonic() > deadline:
                what = "ready but not yet routed by every proxy" if ready else "not ready"
                raise XhpcError(
                    f"{dep.name}: {what} after {timeout_s:.0f}s",
                    hint="the deployment keeps going; follow it with `xhpc ps`",
                )
            time.sleep(POLL_S)
            dep = self.deployment(dep.name)
            if on_update is not None:
                on_update(dep)

    def wait_stopped(
        self, rows: list[ReplicaView], target: str, timeout_s: float
    ) -> list[ReplicaView]:
        """Wait until each of ``rows`` has ended (STOPPED, FAILED); their last states."""
        ids = {r.replica_id for r in rows}
        deadline = time.monotonic() + timeout_s
        while any(r.state not in TERMINAL for r in rows):
            if time.monotonic() > deadline:
                raise XhpcError(f"replicas of {target} not stopped after {timeout_s:.0f}s")
            time.sleep(POLL_S)
            rows = [r for r in self.replicas(all_=True) if r.replica_id in ids]
        return rows

    def wait_scaled(self, result: ScaleResult, timeout_s: float) -> DeploymentView:
        """Wait until the replicas a scale added are READY and those it removed have ended."""
        deadline = time.monotonic() + timeout_s
        while True:
            dep = self.deployment(result.deployment)
            if _settled(dep, result.added, result.removed):
                return dep
            if time.monotonic() > deadline:
                raise XhpcError(f"scaling {result.deployment} not settled after {timeout_s:.0f}s")
            time.sleep(POLL_S)


def _settled(dep: DeploymentView, added: Collection[str], removed: Collection[str]) -> bool:
    states: dict[str, Any] = {r.replica_id: r.state for r in dep.replicas}
    failed = [rid for rid in added if states.get(rid) in GONE]
    if failed:
        raise XhpcError(
            f"replica {failed[0]} is {states[failed[0]].value}",
            hint=f"see `xhpc logs {failed[0]}`",
        )
    return all(states.get(rid) is S.READY for rid in added) and all(
        states.get(rid) in (S.STOPPED, S.FAILED) for rid in removed
    )
