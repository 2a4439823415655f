"""A batch's spec and its view (pure): what the broker writes into the batch's directory for
its array's tasks, and what ``xhpc batch status`` and the Batch API show."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from xhpc.batch.lines import ENDPOINTS
from xhpc.ids import IdKind, check
from xhpc.sbatch_values import PartitionName, QosName, SlurmTime

SPEC_FILE = "batch.json"  # the spec (owner-only directory; no secret in it)
INPUT_FILE = "input.jsonl"  # the input, copied when the batch was created
OUTPUT_FILE = "output.jsonl"
ERROR_FILE = "errors.jsonl"
STATE_FILE = "state.json"  # the broker's record: status, job, times


def progress_path(batch_dir: Path, shard: int) -> Path:
    return batch_dir / "shards" / f"{shard}.jsonl"


class BatchStatus(StrEnum):
    """OpenAI's batch statuses."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ENDED = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED})


class BatchRequest(BaseModel):
    """``xhpc batch submit`` / ``POST /v1/batches`` on the control API."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    # The input, uploaded first (``POST /v1/batch-inputs``): the caller's own.
    input_id: str
    endpoint: str = "/v1/chat/completions"
    engine: str | None = None
    shards: int = Field(default=1, ge=1, le=1000)
    gpus: int = Field(default=1, ge=0, le=64)
    partition: PartitionName | None = None
    qos: QosName | None = None
    time: SlurmTime = "01:00:00"
    concurrency: int = Field(default=8, ge=1, le=256)
    metadata: dict[str, str] = Field(default_factory=dict)
    # Sent to the running replicas of deployment ``model`` instead of a job array of its own.
    online: bool = False

    @field_validator("input_id")
    @classmethod
    def _input_id(cls, value: str) -> str:
        return check(IdKind.BATCH_INPUT, value)

    def endpoint_ok(self) -> bool:
        return self.endpoint in ENDPOINTS


class BatchSpec(BaseModel):
    """What each task of the array reads from the batch's directory."""

    model_config = ConfigDict(frozen=True)

    batch_id: str
    endpoint: str
    model_path: str
    served_model: str
    engine: str
    gpus: int
    shards: int
    concurrency: int = 8
    python: str
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchView(BaseModel):
    """A batch as the broker reports it (the OpenAI batch object's fields, and xhpc's own)."""

    id: str
    object: str = "batch"
    endpoint: str
    model: str
    status: BatchStatus
    created_at: int
    completed_at: int | None = None
    cancelled_at: int | None = None
    owner: str = ""
    job_id: str | None = None
    shards: int = 1
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    output_file: str | None = None  # on the shared filesystem, once the batch ended
    error_file: str | None = None
    errors: list[str] = Field(default_factory=list)
    metadata: dict[str, str] = Field(default_factory=dict)
    requeues: dict[str, int] = Field(default_factory=dict)  # shard -> times xhpc requeued it
    online: bool = False  # sent to a deployment's running replicas (no job of its own)
    # The API key it was made with (through the gateway): its answers' tokens are counted for
    # that key once it ends (None: no key).
    key_id: str | None = None
