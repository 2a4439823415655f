"""``--replica-config``: one replica's own target, as the command line writes it."""

from __future__ import annotations

import json

from pydantic import ValidationError as PydanticValidationError

from xhpc.errors import ValidationError, plain_message
from xhpc.models import ReplicaConfig

_RC_KEYS = ("node", "gpus", "gpu_type", "gpu_idx")


def parse_replica_config(text: str) -> ReplicaConfig:
    """One ``--replica-config``: ``node=n1,gpus=2,gpu_type=a100,gpu_idx=0+1`` (any subset of
    the keys; ``+`` separates GPU indexes) or the same as a JSON object."""
    flag = f"--replica-config {text!r}"
    raw: dict[str, object] = {}
    if text.strip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValidationError(f"{flag}: not valid JSON ({err.msg})") from err
        if not isinstance(data, dict):
            raise ValidationError(f"{flag}: a JSON object is needed")
        raw = {str(k): v for k, v in data.items()}
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
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValidationError(f"{flag}: {where}: {plain_message(first['msg'])}") from err
