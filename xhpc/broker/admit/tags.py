"""Job tags (pure): the ``--comment`` every xhpc job carries, written and read back.

    xhpc:BROKER:DEPLOYMENT:REPLICA      a replica's own job
    xhpc:DEPLOYMENT:REPLICA             the same, written before tags named their broker
    xhpc-pilot:BROKER:PILOT             a pilot job (its replicas run inside it)
    xhpc-unit:BROKER:DEPLOYMENT:UNIT    a PD unit's heterogeneous job

Every part is a name (``NAME_RE``): a comment that is anything else is not xhpc's tag. The tag is
how a job is found again when its id was never recorded (sbatch killed at its timeout after
Slurm accepted the job, a broker crash between sbatch and the store).
"""

from __future__ import annotations

from enum import StrEnum

from xhpc.models import NAME_RE, Frozen

REPLICA_PREFIX = "xhpc:"
PILOT_PREFIX = "xhpc-pilot:"
UNIT_PREFIX = "xhpc-unit:"


class TagKind(StrEnum):
    REPLICA = "replica"
    PILOT = "pilot"
    UNIT = "unit"


class JobTag(Frozen):
    kind: TagKind
    broker: str | None  # None: a replica tag from before tags named their broker
    deployment: str | None  # None for a pilot (it serves several deployments)
    name: str  # the replica, pilot or unit id


def job_tag(broker_id: str, deployment: str, replica_id: str) -> str:
    """The job's ``--comment``: whose broker, which deployment, which replica."""
    return f"{REPLICA_PREFIX}{broker_id}:{deployment}:{replica_id}"


def pilot_tag(broker_id: str, pilot_id: str) -> str:
    return f"{PILOT_PREFIX}{broker_id}:{pilot_id}"


def unit_tag(broker_id: str, deployment: str, unit_id: str) -> str:
    """A PD unit's hetjob: its instances' rows name the job, not a replica of the tag."""
    return f"{UNIT_PREFIX}{broker_id}:{deployment}:{unit_id}"


def _parts(comment: str, prefix: str, counts: tuple[int, ...]) -> list[str] | None:
    parts = comment[len(prefix) :].split(":")
    if len(parts) not in counts or not all(NAME_RE.fullmatch(p) for p in parts):
        return None
    return parts


def read_tag(comment: str | None) -> JobTag | None:
    """The tag in a job's comment, or None when the comment is not exactly one of xhpc's."""
    if not comment or not comment.startswith("xhpc"):
        return None
    if comment.startswith(REPLICA_PREFIX):
        parts = _parts(comment, REPLICA_PREFIX, (2, 3))
        if parts is None:
            return None
        broker = parts[0] if len(parts) == 3 else None
        return JobTag(kind=TagKind.REPLICA, broker=broker, deployment=parts[-2], name=parts[-1])
    if comment.startswith(PILOT_PREFIX):
        parts = _parts(comment, PILOT_PREFIX, (2,))
        if parts is None:
            return None
        return JobTag(kind=TagKind.PILOT, broker=parts[0], deployment=None, name=parts[1])
    if comment.startswith(UNIT_PREFIX):
        parts = _parts(comment, UNIT_PREFIX, (3,))
        if parts is None:
            return None
        return JobTag(kind=TagKind.UNIT, broker=parts[0], deployment=parts[1], name=parts[2])
    return None
