"""Device picking inside a pilot allocation (pure): Xinference's worker ``allocate_devices``.

Inside its own allocation the pilot's device table is authoritative: which GPUs the job can
see, which replicas hold which of them, and (when NVML answers) how much memory each has in
use. Idle-first: GPUs held by fewer replicas first, then less memory in use, then the lower
index. With GPU sharing off a GPU held by a replica is never offered again: when too few are
left the request is refused with "No available slot".
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field


class SlotError(Exception):
    """The pilot cannot place this replica; the message is shown to the user as is."""


class DeviceTable(BaseModel):
    model_config = ConfigDict(frozen=True)

    devices: tuple[int, ...]  # what the job can see (SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES)
    held: dict[str, tuple[int, ...]] = Field(default_factory=dict)  # replica -> its GPUs
    mem_used_mb: dict[int, float] = Field(default_factory=dict)  # from NVML, when it answers

    def holders(self, gpu: int) -> int:
        return sum(gpu in gpus for gpus in self.held.values())

    def with_held(self, replica_id: str, gpus: Sequence[int]) -> DeviceTable:
        return self.model_copy(update={"held": {**self.held, replica_id: tuple(gpus)}})

    def without(self, replica_id: str) -> DeviceTable:
        held = {k: v for k, v in self.held.items() if k != replica_id}
        return self.model_copy(update={"held": held})


def _shown(indexes: Sequence[int]) -> str:
    return ",".join(str(i) for i in indexes) or "none"


def allocate_devices(
    table: DeviceTable,
    replica_id: str,
    count: int,
    pinned: Sequence[int] = (),
    *,
    sharing: bool = False,
) -> tuple[int, ...]:
    """The GPU indexes ``replica_id`` gets, or SlotError. Never mutates ``table``."""
    if count < 1:
        raise SlotError(f"replica {replica_id} asks for {count} GPUs")
    if pinned:
        outside = [g for g in pinned if g not in table.devices]
        if outside:
            raise SlotError(
                f"pinned GPU(s) {_shown(outside)} of replica {replica_id} are not in this "
                f"pilot's allocation (it holds GPU(s) {_shown(table.devices)})"
            )
        if len(pinned) != count:
            raise SlotError(f"replica {replica_id} pins {len(pinned)} GPU(s) but asks for {count}")
        if not sharing:
            taken = {g: r for r, gpus in table.held.items() for g in gpus if g in pinned}
            if taken:
                who = ", ".join(f"GPU {g} by {r}" for g, r in sorted(taken.items()))
                raise SlotError(
                    f"No available slot: replica {replica_id} is pinned to GPUs already held "
                    f"({who}) and gpu sharing is off"
                )
        return tuple(pinned)
    candidates = [g for g in table.devices if sharing or table.holders(g) == 0]
    if len(candidates) < count:
        raise SlotError(
            f"No available slot for replica {replica_id}: it needs {count} GPU(s), "
            f"{len(candidates)} of this pilot's {len(table.devices)} are free"
            + ("" if sharing else " and gpu sharing is off")
        )
    ranked = sorted(candidates, key=lambda g: (table.holders(g), table.mem_used_mb.get(g, 0.0), g))
    return tuple(sorted(ranked[:count]))
