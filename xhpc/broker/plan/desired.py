"""A deployment as desired state: the request stored once, read back as the typed request.

The deployment row keeps the `ServeRequest` as served (JSON) plus what the reconcile loop keeps
true: how many replicas (or PD units) are wanted, the restart policy and when the deployment ends
by itself. Scaling and replacing read the request back instead of re-assembling it from columns.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from xhpc.clock import utcnow
from xhpc.errors import ValidationError
from xhpc.models import EngineKind, RestartPolicy, ScalingPolicy, ServeRequest
from xhpc.records import DeploymentRecord
from xhpc.settings import XhpcConfig
from xhpc.slurm.partitions import parse_slurm_time


def served_deployment(
    req: ServeRequest,
    name: str,
    model_path: str,
    engine: EngineKind,
    owner: str | None,
    config: XhpcConfig,
    *,
    now: datetime | None = None,
) -> DeploymentRecord:
    """A deployment as served: the request itself, and what reads and admin tools use."""
    now = now or utcnow()
    minutes = parse_slurm_time(req.run_for) if req.run_for else None
    if req.run_for and minutes == 0:
        raise ValidationError(
            f"--for {req.run_for!r} must be a positive duration", hint="e.g. --for 7-00:00:00"
        )
    return DeploymentRecord(
        name=name,
        model=req.model,
        model_path=model_path,
        engine=engine,
        gpus=req.gpus,
        partition=req.partition,
        time_limit=req.time,
        nodelist=req.nodelist,
        engine_args=tuple(req.engine_args),
        created_at=now,
        gpu_type=req.gpu_type,
        pilot_node=req.pilot,
        owner=owner,
        account=config.slurm.account,
        pd=req.pd,
        prefill_gpus=req.prefill_gpus,
        decode_gpus=req.decode_gpus,
        prefill_args=tuple(req.prefill_args),
        decode_args=tuple(req.decode_args),
        request=req.model_dump_json(exclude_defaults=True),
        wanted=req.replicas,
        restart=req.restart or RestartPolicy(config.lifecycle.restart),
        until_at=now + timedelta(minutes=minutes) if minutes else None,
    )


def stored_request(dep: DeploymentRecord, replicas: int) -> ServeRequest:
    """``replicas`` more of what ``dep`` serves, as its owner asked for it (per-replica configs
    and a pilot's size belong to the first launch only)."""
    if dep.request:
        req = ServeRequest.model_validate_json(dep.request)
        return req.model_copy(
            update={"name": dep.name, "replicas": replicas, "replica_configs": ()}
        )
    # Deployments served before the request was stored: re-assembled from the columns.
    return ServeRequest(
        model=dep.model,
        name=dep.name,
        replicas=replicas,
        gpus=dep.gpus,
        engine=dep.engine,
        partition=dep.partition,
        time=dep.time_limit,
        nodelist=dep.nodelist,
        engine_args=dep.engine_args,
        gpu_type=dep.gpu_type,
        pilot=dep.pilot_node,
        pd=dep.pd,
        prefill_gpus=dep.prefill_gpus,
        decode_gpus=dep.decode_gpus,
        prefill_args=dep.prefill_args,
        decode_args=dep.decode_args,
    )


def policy_of(dep: DeploymentRecord) -> ScalingPolicy | None:
    """The deployment's scaling policy, as it was served (None: a fixed count)."""
    if not dep.request:
        return None
    return ServeRequest.model_validate_json(dep.request).scaling


def asleep(dep: DeploymentRecord) -> bool:
    """Live, at zero replicas by its scaling policy: listed, woken by a call."""
    return dep.stopped_at is None and dep.wanted == 0 and dep.sleeping


def stopping(dep: DeploymentRecord) -> bool:
    """Stopped (by its owner, or the broker), its replicas not all ended yet: at zero and not
    asleep. Nothing starts it again; a new `xhpc serve` does."""
    return dep.stopped_at is None and dep.wanted == 0 and not dep.sleeping
