"""Admission rules, one table per rule, on nodes and partitions captured from the dev cluster.

Nodes come from tests/data/slurm/sinfo-{idle,busy}.json (3 x 4 untyped GPUs, partition `gpu`;
in sinfo-busy n3 is MIXED+DRAIN, reason "test"); partitions from scontrol-show-partition.txt
(`gpu`, Default=YES, MaxTime=1-00:00:00). A GPU type or a second partition is set on copies of the
captured nodes where a rule needs one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError as PydanticValidationError

from xhpc.broker.admit.admission import (
    DEFAULT_ENGINE_ARGS,
    admission_problems,
)
from xhpc.config import EngineConfig, SlurmConfig, XhpcConfig
from xhpc.models import EngineKind, NodeInfo, PartitionInfo, ReplicaConfig, ServeRequest
from xhpc.settings import LifecycleConfig
from xhpc.slurm.partitions import parse_partitions

VLLM, TRANSFORMERS, COMMAND = EngineKind.VLLM, EngineKind.TRANSFORMERS, EngineKind.COMMAND
RC = ReplicaConfig
Output = Callable[[str], str]


@pytest.fixture
def parts(slurm_output: Output) -> list[PartitionInfo]:
    return parse_partitions(slurm_output("scontrol-show-partition.txt"))


@pytest.fixture
def typed_nodes(idle_nodes: list[NodeInfo]) -> list[NodeInfo]:
    """n1, n2: a100; n3: h100."""
    types = {"n1": "a100", "n2": "a100", "n3": "h100"}
    return [n.model_copy(update={"gpu_type": types[n.name]}) for n in idle_nodes]


def check(
    nodes: Sequence[NodeInfo],
    partitions: Sequence[PartitionInfo] | None = None,
    config: XhpcConfig | None = None,
    engine: EngineKind = VLLM,
    **req: object,
) -> list[str]:
    request = ServeRequest.model_validate({"model": "m", **req})
    return admission_problems(request, nodes, config or XhpcConfig(), engine, partitions)


# -- partition, GPU count, --nodelist, engine (the first checks) ---------------------------------
def problems(
    req: ServeRequest,
    nodes: list[NodeInfo],
    config: XhpcConfig | None = None,
    engine: EngineKind = VLLM,
) -> list[str]:
    return admission_problems(req, nodes, config or XhpcConfig(), engine)


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_fitting_request_is_admitted(idle_nodes: list[NodeInfo], gpus: int) -> None:
    assert problems(ServeRequest(model="m", gpus=gpus, partition="gpu"), idle_nodes) == []


def test_zero_gpus_is_refused_by_the_request_model() -> None:
    with pytest.raises(PydanticValidationError):
        ServeRequest(model="m", gpus=0)


def test_more_gpus_than_any_node(idle_nodes: list[NodeInfo]) -> None:
    found = problems(ServeRequest(model="m", gpus=5), idle_nodes)
    assert "--gpus 5 is more than any node has (largest: 4 GPUs)" in found


def test_unknown_partition_lists_known_ones(idle_nodes: list[NodeInfo]) -> None:
    found = problems(ServeRequest(model="m", partition="cpu"), idle_nodes)
    assert found == ["unknown partition 'cpu' (known: gpu)"]


def test_partition_from_config(idle_nodes: list[NodeInfo]) -> None:
    config = XhpcConfig(slurm=SlurmConfig(partition="nope"))
    assert problems(ServeRequest(model="m"), idle_nodes, config) == [
        "unknown partition 'nope' (known: gpu)"
    ]


def test_unknown_node_in_nodelist(idle_nodes: list[NodeInfo]) -> None:
    assert problems(ServeRequest(model="m", nodelist="n2"), idle_nodes) == []
    found = problems(ServeRequest(model="m", nodelist="n1,n9,n10"), idle_nodes)
    assert found == ["unknown node(s) n9, n10 in the partition"]


def test_drained_nodes_are_not_usable(busy_nodes: list[NodeInfo]) -> None:
    drained = [n for n in busy_nodes if n.name == "n3"]
    assert problems(ServeRequest(model="m"), drained) == [
        "no usable node (all are down, drained or too small)"
    ]
    # Busy but healthy nodes still admit: the job waits in the queue.
    assert problems(ServeRequest(model="m", gpus=4), busy_nodes) == []


def test_all_problems_are_reported_at_once(idle_nodes: list[NodeInfo]) -> None:
    found = problems(
        ServeRequest(model="m", gpus=8, nodelist="n1,n7"), idle_nodes, engine=EngineKind.COMMAND
    )
    assert found == [
        "--gpus 8 is more than any node has (largest: 4 GPUs)",
        "unknown node(s) n7 in the partition",
        "node n1 has only 4 GPUs",
        "engine 'command' has no command configured in the site config",
    ]
    found = problems(ServeRequest(model="m", gpus=1, partition="cpu", nodelist="n1"), idle_nodes)
    assert len(found) == 2
    assert found[0].startswith("unknown partition 'cpu'")
    assert "unknown node(s) n1 in the partition" in found


def test_pinning_to_a_drained_node_is_refused(busy_nodes: list[NodeInfo]) -> None:
    found = problems(ServeRequest(model="m", gpus=1, nodelist="n1,n3"), busy_nodes)
    assert found == ["node n3 is not usable (MIXED+DRAIN: test)"]


def test_engine_python_must_exist(idle_nodes: list[NodeInfo], tmp_path: Path) -> None:
    config = XhpcConfig(engines={VLLM: EngineConfig(python=tmp_path / "nope" / "python")})
    (found,) = problems(ServeRequest(model="m"), idle_nodes, config)
    assert "does not exist" in found and "nope" in found


def test_no_nodes_at_all_reports_nothing_about_gpus() -> None:
    assert problems(ServeRequest(model="m", gpus=2), []) == []


# -- partition: state, default, MaxTime ----------------------------------------------------------
@pytest.mark.parametrize(
    ("req", "expected"),
    [
        ({"time": "1-00:00:00"}, []),
        ({"time": "24:00:00"}, []),
        (
            {"time": "2-00:00:00"},
            ["--time 2-00:00:00 is longer than MaxTime 1-00:00:00 of partition 'gpu'"],
        ),
        (
            {"time": "UNLIMITED"},
            ["--time UNLIMITED is longer than MaxTime 1-00:00:00 of partition 'gpu'"],
        ),
        (
            {"time": "2-00:00:00", "partition": "gpu"},
            ["--time 2-00:00:00 is longer than MaxTime 1-00:00:00 of partition 'gpu'"],
        ),
    ],
)
def test_time_limit_against_the_partition(
    idle_nodes: list[NodeInfo], parts: list[PartitionInfo], req: dict[str, object],
    expected: list[str],
) -> None:  # fmt: skip
    # No partition named: Slurm's default partition (Default=YES) applies.
    assert check(idle_nodes, parts, **req) == expected


def test_time_limit_needs_the_partitions(idle_nodes: list[NodeInfo]) -> None:
    assert check(idle_nodes, None, time="9-00:00:00") == []


def test_site_default_time_is_checked_too(
    idle_nodes: list[NodeInfo], parts: list[PartitionInfo]
) -> None:
    config = XhpcConfig(slurm=SlurmConfig(default_time="3-00:00:00"))
    assert check(idle_nodes, parts, config) == [
        "the default time limit (slurm.default_time) 3-00:00:00 is longer than MaxTime "
        "1-00:00:00 of partition 'gpu'"
    ]


@pytest.mark.parametrize(
    ("floor_s", "time", "shortest"),
    [
        (120, "00:00:10", "00:03:00"),  # the 60 s warning + a successor 120 s before the end
        (120, "2", "00:03:00"),  # Slurm's bare number: minutes
        (300, "00:05:00", "00:06:00"),
        (90, "00:02:00", "00:03:00"),  # 150 s, in whole minutes as Slurm counts
    ],
)
def test_a_time_limit_too_short_to_serve_is_refused_with_the_minimum(
    idle_nodes: list[NodeInfo], floor_s: float, time: str, shortest: str
) -> None:
    config = XhpcConfig(lifecycle=LifecycleConfig(handover_floor_s=floor_s))
    assert check(idle_nodes, None, config, time=time) == [
        f"--time {time} is too short: Slurm warns the job 60 s before its limit (its replicas "
        f"drain then) and a successor is started {floor_s:g} s before its end ([lifecycle] "
        f"handover_floor_s); use at least {shortest}"
    ]
    assert check(idle_nodes, None, config, time=shortest) == []  # the minimum itself is fine


def test_a_too_short_site_default_time_is_refused_too(idle_nodes: list[NodeInfo]) -> None:
    config = XhpcConfig(slurm=SlurmConfig(default_time="00:02:00"))
    (found,) = check(idle_nodes, None, config)
    assert found.startswith("the default time limit (slurm.default_time) 00:02:00 is too short")
    assert found.endswith("use at least 00:03:00")


def test_partition_state_and_emptiness(
    idle_nodes: list[NodeInfo], parts: list[PartitionInfo]
) -> None:
    down = [parts[0].model_copy(update={"state": "DOWN"})]
    assert check(idle_nodes, down) == ["partition 'gpu' is DOWN, not UP: it starts no jobs"]
    empty = [*parts, PartitionInfo(name="spare", nodes=None)]
    assert check(idle_nodes, empty, partition="spare") == ["partition 'spare' has no nodes"]
    assert check(idle_nodes, parts, partition="cpu") == ["unknown partition 'cpu' (known: gpu)"]


# -- nodes: exist, in the partition, usable, count -----------------------------------------------
def test_nodes_in_another_partition_are_not_candidates(idle_nodes: list[NodeInfo]) -> None:
    nodes = [
        n.model_copy(update={"partitions": ("cpu",)}) if n.name == "n2" else n for n in idle_nodes
    ]
    assert check(nodes, partition="gpu", nodelist="n1,n2") == [
        "unknown node(s) n2 in the partition"
    ]
    assert check(nodes, partition="gpu", replicas=2, replica_configs=[{}, {"node": "n2"}]) == [
        "replica 1: node n2 is not in partition 'gpu'"
    ]


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        ([{"node": "n1"}, {"node": "n2"}], []),
        ([{"node": "n9"}, {}], ["replica 0: unknown node n9"]),
        ([{"node": "n9"}, {"node": "n9"}], ["replicas 0 and 1: unknown node n9"]),
        ([{}, {"node": "n3"}], ["replica 1: node n3 is not usable (MIXED+DRAIN: test)"]),
        ([{"node": "n1", "gpus": 5}, {}], ["replica 0: node n1 has only 4 GPUs, not 5"]),
        ([{}, {"gpus": 8}], ["replica 1 (8 GPUs) is more than any node has (largest: 4 GPUs)"]),
        ([{"node": "n1"}], ["1 replica configs for 2 replicas (give one per replica, or none)"]),
    ],
)
def test_replica_config_targets(
    busy_nodes: list[NodeInfo], configs: list[dict[str, object]], expected: list[str]
) -> None:
    assert check(busy_nodes, replicas=2, replica_configs=configs) == expected


def test_replica_node_must_be_inside_the_nodelist(idle_nodes: list[NodeInfo]) -> None:
    found = check(idle_nodes, nodelist="n[1-2]", replica_configs=[{"node": "n3"}])
    assert found == ["replica 0: node n3 is outside --nodelist"]


def test_bad_nodelist_expression(idle_nodes: list[NodeInfo]) -> None:
    (found,) = check(idle_nodes, nodelist="n[1-")
    assert found.startswith("--nodelist: hostlist 'n[1-'")


# -- GPU type ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("req", "expected"),
    [
        ({"gpu_type": "a100", "gpus": 4}, []),
        ({"gpu_type": "h100", "nodelist": "n3"}, []),
        (
            {"gpu_type": "v100"},
            ["no node in partition 'gpu' has GPUs of type 'v100' (there: a100, h100)"],
        ),
        ({"gpu_type": "a100", "nodelist": "n2,n3"}, ["node n3 has no GPUs of type 'a100' (h100)"]),
        (
            {"gpu_type": "a100", "gpus": 5},
            ["--gpus 5 is more than any node of type 'a100' has (largest: 4 GPUs)"],
        ),
        (
            {"replicas": 2, "replica_configs": [{"node": "n3", "gpu_type": "a100"}, {}]},
            ["replica 0: node n3 has no GPUs of type 'a100' (h100)"],
        ),
        ({"replicas": 2, "gpu_type": "a100", "replica_configs": [{}, {"gpu_type": "h100"}]}, []),
    ],
)
def test_gpu_type(typed_nodes: list[NodeInfo], req: dict[str, object], expected: list[str]) -> None:
    assert check(typed_nodes, partition="gpu", **req) == expected


def test_untyped_nodes_fit_no_type(idle_nodes: list[NodeInfo]) -> None:
    assert check(idle_nodes, gpu_type="a100", partition="gpu") == [
        "no node in partition 'gpu' has GPUs of type 'a100' (there: untyped)"
    ]


# -- pinned GPU indexes ----------------------------------------------------------------------------
def pins(nodes: Sequence[NodeInfo], *configs: dict[str, object], **kw: object) -> list[str]:
    request = ServeRequest(model="m", replicas=len(configs), replica_configs=configs)  # type: ignore[arg-type]
    return admission_problems(request, nodes, XhpcConfig(), VLLM, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        ([{"node": "n1", "gpu_idx": [0]}, {"node": "n1", "gpu_idx": [1]}], []),
        ([{"node": "n1", "gpu_idx": [1]}, {"node": "n2", "gpu_idx": [1]}], []),
        (
            [
                {"node": "n1", "gpu_idx": [0]},
                {"node": "n2", "gpu_idx": [1]},
                {"node": "n1", "gpu_idx": [0]},
            ],
            ["replicas 0 and 2 are both pinned to GPU 0 on n1 (gpu sharing is off)"],
        ),
        (
            [
                {"node": "n1", "gpu_idx": [0]},
                {"node": "n1", "gpu_idx": [0]},
                {"node": "n1", "gpu_idx": [0]},
            ],
            ["replicas 0, 1 and 2 are all pinned to GPU 0 on n1 (gpu sharing is off)"],
        ),
        (
            [
                {"node": "n2", "gpus": 2, "gpu_idx": [2, 3]},
                {"node": "n2", "gpus": 2, "gpu_idx": [3, 2]},
            ],
            ["replicas 0 and 1 are both pinned to GPUs 2, 3 on n2 (gpu sharing is off)"],
        ),
        ([{"node": "n1", "gpu_idx": [4]}], ["replica 0: pins GPU 4, which n1 lacks (GPUs 0-3)"]),
        (
            [{"node": "n1", "gpus": 2, "gpu_idx": [1]}],
            ["replica 0: pins 1 GPU index(es) but asks for 2 GPUs"],
        ),
        ([{"node": "n1", "gpus": 2, "gpu_idx": [1, 1]}], ["replica 0: pins GPU 1 more than once"]),
        ([{"gpu_idx": [0]}], ["replica 0: pins GPU indexes but names no node (node=...)"]),
    ],
)
def test_pins_inside_a_pilot(
    idle_nodes: list[NodeInfo], configs: list[dict[str, object]], expected: list[str]
) -> None:
    assert pins(idle_nodes, *configs, pilot=True) == expected


def test_shared_pins_are_fine_when_sharing_is_on(idle_nodes: list[NodeInfo]) -> None:
    same = {"node": "n1", "gpu_idx": [0]}
    assert pins(idle_nodes, same, same, pilot=True, gpu_sharing=True) == []


def test_single_node_nodelist_is_where_pins_go(idle_nodes: list[NodeInfo]) -> None:
    request = ServeRequest(
        model="m", replicas=2, nodelist="n2", replica_configs=(RC(gpu_idx=(1,)), RC(gpu_idx=(1,)))
    )
    found = admission_problems(request, idle_nodes, XhpcConfig(), VLLM, pilot=True)
    assert found == ["replicas 0 and 1 are both pinned to GPU 1 on n2 (gpu sharing is off)"]


def test_pins_without_a_pilot_are_refused_with_everything_else(idle_nodes: list[NodeInfo]) -> None:
    found = pins(idle_nodes, {"node": "n1", "gpu_idx": [1]}, {}, {"node": "n1", "gpu_idx": [1]})
    assert found == [
        "replicas 0 and 2 are both pinned to GPU 1 on n1 (gpu sharing is off)",
        "replicas 0 and 2 pin GPU indexes, which needs --pilot: xhpc can only choose GPU indexes "
        "inside a pilot allocation (Slurm picks them for a plain job)",
    ]


# -- account / QOS ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("accounting", "account", "qos", "expected"),
    [
        (False, "bio", "low", []),  # accounting_storage/none (the dev cluster): skipped
        (True, "physics", "normal", []),
        (True, None, None, []),
        (True, "bio", None, ["account 'bio' may not use partition 'gpu' (AllowAccounts=physics)"]),
        (True, "physics", "low", ["QOS 'low' is denied partition 'gpu' (DenyQos=low)"]),
    ],
)
def test_account_and_qos(
    idle_nodes: list[NodeInfo],
    parts: list[PartitionInfo],
    accounting: bool,
    account: str | None,
    qos: str | None,
    expected: list[str],
) -> None:
    limited = [parts[0].model_copy(update={"allow_accounts": ("physics",), "deny_qos": ("low",)})]
    config = XhpcConfig(slurm=SlurmConfig(account=account))
    request = ServeRequest(model="m")
    found = admission_problems(
        request, idle_nodes, config, VLLM, limited, accounting=accounting, qos=qos
    )
    assert found == expected


def test_real_partition_allows_every_account(
    idle_nodes: list[NodeInfo], parts: list[PartitionInfo]
) -> None:
    config = XhpcConfig(slurm=SlurmConfig(account="anyone"))
    found = admission_problems(
        ServeRequest(model="m"), idle_nodes, config, VLLM, parts, accounting=True, qos="any"
    )
    assert found == []


# -- all at once -----------------------------------------------------------------------------------
def test_every_problem_at_once(
    busy_nodes: list[NodeInfo], parts: list[PartitionInfo], tmp_path: Path
) -> None:
    config = XhpcConfig(engines={VLLM: EngineConfig(python=tmp_path / "nope" / "python")})
    request = ServeRequest(
        model="m",
        replicas=4,
        gpus=2,
        time="2-00:00:00",
        engine_args=("--port", "1"),
        replica_configs=(
            RC(node="n1", gpu_idx=(0, 1)),
            RC(node="n3"),
            RC(node="n9"),
            RC(node="n1", gpu_idx=(1, 7)),
        ),
    )
    found = admission_problems(request, busy_nodes, config, VLLM, parts)
    assert found == [
        "replica 1: node n3 is not usable (MIXED+DRAIN: test)",
        "replica 2: unknown node n9",
        "replica 3: pins GPU 7, which n1 lacks (GPUs 0-3)",
        "replicas 0 and 3 are both pinned to GPU 1 on n1 (gpu sharing is off)",
        "replicas 0 and 3 pin GPU indexes, which needs --pilot: xhpc can only choose GPU "
        "indexes inside a pilot allocation (Slurm picks them for a plain job)",
        "--time 2-00:00:00 is longer than MaxTime 1-00:00:00 of partition 'gpu'",
        f"engine 'vllm': its Python {tmp_path / 'nope' / 'python'} does not exist (make it "
        "with `scripts/setup-engines vllm` in an xhpc checkout, or point [engines.vllm] python "
        "at an existing environment)",
        "engine argument(s) not allowed for vllm: --port (xhpc sets it); allowed: "
        + " ".join(sorted(DEFAULT_ENGINE_ARGS[VLLM] or ())),
    ]


def test_fitting_request_with_everything_is_admitted(
    typed_nodes: list[NodeInfo], parts: list[PartitionInfo]
) -> None:
    request = ServeRequest(
        model="m",
        replicas=3,
        gpus=2,
        gpu_type="a100",
        time="12:00:00",
        engine_args=("--max-model-len", "512"),
        replica_configs=(RC(node="n1"), RC(), RC(node="n3", gpu_type="h100", gpus=4)),
    )
    found = admission_problems(request, typed_nodes, XhpcConfig(), VLLM, parts, accounting=True)
    assert found == []
