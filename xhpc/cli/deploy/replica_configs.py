"""``--replica-config``: one replica's own target, as the command line writes it."""

from __future__ import annotations

from pydantic import ValidationError as PydanticValidationError

from xhpc.errors import ValidationError, first_problem, json_object
from xhpc.models import ReplicaConfig

_RC_KEYS = ("node", "gpus", "gpu_type", "gpu_idx")


def parse_replica_config(text: str) -> ReplicaConfig:
    """One ``--replica-config``: ``node=n1,gpus=2,gpu_type=a100,gpu_idx=0+1`` (any subset of
    the keys; ``+`` separates GPU indexes) or the same as a JSON object."""
    flag = f"--replica-config {text!r}"
    raw: dict[str, object] = {}
    if text.strip().startswith("{"):
        raw = json_object(text, flag)
    else:
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep:
                raise ValidationError(f"{flag}: {item!r} is not KEY=VALUE")
            if key in raw:
                raise ValidationError(f"{flag}: {key} given twice")
            raw[key] = [v for v in value.split("+") if v] if key == "gpu_idx" else value
    unknown = sorted(set(raw) - set(_RC_KEYS))
    if unknown:
        raise ValidationError(
            f"{flag}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(_RC_KEYS)})"
        )
    try:
        return ReplicaConfig.model_validate(raw)
    except PydanticValidationError as err:
        raise first_problem(err, flag) from err
