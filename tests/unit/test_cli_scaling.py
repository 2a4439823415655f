"""`xhpc serve`'s autoscaling flags become one ScalingPolicy, or one clear error."""

from __future__ import annotations

import pytest

from xhpc.cli.deploy.serve import scaling_of
from xhpc.errors import ValidationError


def test_no_flags_is_no_policy_and_every_knob_is_kept() -> None:
    assert scaling_of(None, None, None, None, None, None) is None
    policy = scaling_of(0, 3, 2.0, 1.5, 60.0, 45.0)
    assert policy is not None
    assert (policy.min_replicas, policy.max_replicas, policy.target) == (0, 3, 2.0)
    assert (policy.ttft_s, policy.idle_s, policy.down_window_s) == (1.5, 60.0, 45.0)
    default = scaling_of(None, 2, None, None, None, None)
    assert default is not None and (default.min_replicas, default.down_window_s) == (1, 300.0)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((None, None, None, None, None, 30.0), "need --max"),
        ((None, None, 2.0, None, None, None), "need --max"),
        ((1, None, None, None, None, None), "--min needs --max"),
        ((0, 2, None, None, None, 5.0), "--down-window"),
        ((3, 2, None, None, None, None), "over max replicas"),
    ],
)
def test_a_knob_alone_or_out_of_range_is_one_error(
    args: tuple[int | None, int | None, float | None, float | None, float | None, float | None],
    says: str,
) -> None:
    with pytest.raises(ValidationError, match=says.replace("-", "\\-")):
        scaling_of(*args)
