"""The site's ``[policy]``: one check that every door's job passes
(xhpc.broker.admit.job_policy)."""

from __future__ import annotations

import pytest

from xhpc.broker.admit.admission import admission_problems
from xhpc.broker.admit.job_policy import JobShape, policy_problems
from xhpc.models import EngineKind, ServeRequest
from xhpc.settings import XhpcConfig

POLICY = {
    "max_gpus": 4,
    "max_time": "1-00:00:00",
    "max_shards": 8,
    "partitions": {"*": ["gpu"], "lab1": ["gpu", "long"]},
    "qos": {"*": ["normal"]},
}


def config(**slurm: str) -> XhpcConfig:
    return XhpcConfig.model_validate({"policy": POLICY, "slurm": slurm})


def test_a_shape_within_the_policy_has_no_problem() -> None:
    shape = JobShape("the batch", gpus=4, time="23:59:00", partition="gpu", qos="normal")
    assert policy_problems(shape, config()) == []


def test_every_cap_is_named_at_once() -> None:
    shape = JobShape("the batch", gpus=64, time="UNLIMITED", partition="long", qos="high",
                     tasks=9)  # fmt: skip
    problems = policy_problems(shape, config())
    assert len(problems) == 5, problems
    joined = " | ".join(problems)
    for needle in ("64 GPUs", "max_gpus", "9 shards", "UNLIMITED", "1-00:00:00",
                   "partition 'long'", "QoS 'high'"):  # fmt: skip
        assert needle in joined


def test_an_account_named_in_the_policy_gets_its_own_partitions() -> None:
    shape = JobShape("the deployment", gpus=1, time="01:00:00", partition="long")
    assert policy_problems(shape, config(account="lab1")) == []
    assert policy_problems(shape, config(account="lab2")) != []


def test_the_sites_default_partition_counts_when_the_request_names_none() -> None:
    shape = JobShape("the deployment", gpus=1, time="01:00:00")
    assert policy_problems(shape, config(partition="gpu")) == []
    assert "Slurm's default partition" in policy_problems(shape, config())[0]


def test_no_policy_refuses_nothing() -> None:
    shape = JobShape("x", gpus=1024, time="UNLIMITED", partition="any", qos="any", tasks=100)
    assert policy_problems(shape, XhpcConfig()) == []


@pytest.mark.adversarial
def test_serve_admission_applies_the_policy_to_pd_components_and_pilots() -> None:
    """A PD component's or a pilot's GPUs count, not only --gpus."""
    cfg = config(partition="gpu")
    pd = ServeRequest(model="m", gpus=1, pd="1P1D", decode_gpus=8)
    pilot = ServeRequest(model="m", gpus=1, pilot="n1", pilot_gpus=16)
    for req in (pd, pilot):
        problems = admission_problems(req, [], cfg, EngineKind.COMMAND)
        assert any("max_gpus" in p for p in problems), problems
