"""Bad input against the real cluster: one-line errors, non-zero exits, nothing submitted."""

from __future__ import annotations

import pytest

from tests.conftest import Xhpc

pytestmark = pytest.mark.cluster


def _refused(x: Xhpc, *args: str, code: int) -> str:
    proc = x.run("serve", *args, "--detach", check=False)
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["no-such-model"], 3, "unknown model"),
        (["tiny-llama", "--gpus", "0"], 2, "--gpus must be at least 1"),
        (["tiny-llama", "--gpus", "5"], 2, "more than any node has (largest: 4 GPUs)"),
        (["tiny-llama", "--partition", "nosuch"], 2, "unknown partition 'nosuch'"),
        (["tiny-llama", "--replicas", "0"], 2, "--replicas must be at least 1"),
        (["tiny-llama", "--time", "soon"], 2, "invalid time limit"),
        (["x'; touch /tmp/xhpc-pwned; echo '"], 2, "invalid model name"),
        (["tiny\nllama"], 2, "control characters"),
        (["tiny-llama", "--name", "a;b"], 2, "invalid"),
        (["tiny-llama", "--name", 'a"$(id)'], 2, "invalid"),
        (["tiny-llama", "--engine-arg", "--x", "--engine", "command"], 2, "no command configured"),
        (["tiny-llama", "--time", "00:00:10"], 2, "is too short"),
        (["tiny-llama", "--engine-arg", "; rm -rf /"], 2, "each must be one word of"),
        (["tiny-llama", "--nodes", "0"], 2, "--nodes must be at least 1"),
        (["tiny-llama", "--nodes", "4"], 2, "--nodes 4 needs 4 usable nodes"),
        (["tiny-llama", "--nodes", "2"], 2, "only the vllm engine spans nodes"),
        (
            ["tiny-llama", "--nodes", "2", "--engine", "vllm", "--engine-arg=-tp=3"],
            2,
            "is not the 2 x 1 = 2 GPUs",
        ),
        (["tiny-llama", "--prefill-nodes", "0"], 2, "--prefill-nodes must be at least 1"),
        (["tiny-llama", "--decode-nodes", "2"], 2, "--decode-nodes applies to --pd units only"),
        (
            [
                "tiny-llama",
                "--engine",
                "vllm",
                "--pd",
                "1P1D",
                "--decode-nodes",
                "2",
                "--decode-arg=-pp=2",
            ],
            2,
            "tensor parallelism only",
        ),
        (
            ["tiny-llama", "--engine", "vllm", "--pd", "1P1D", "--nodes", "2"],
            2,
            "needs 4 nodes",
        ),
    ],
)
def test_bad_request_submits_nothing(xhpc: Xhpc, args: list[str], code: int, needle: str) -> None:
    line = _refused(xhpc, *args, code=code)
    assert needle in line
    assert xhpc.my_jobs() == []
    assert xhpc.json("ps", "--all") == []


def test_every_problem_is_named_at_once(xhpc: Xhpc) -> None:
    line = _refused(xhpc, "tiny-llama", "--gpus", "9", "--nodelist", "n1,n9", code=2)
    assert "more than any node has" in line
    assert "unknown node(s) n9" in line
    assert xhpc.my_jobs() == []


def test_dry_run_prints_the_script_and_submits_nothing(xhpc: Xhpc, unique_name: str) -> None:
    out = xhpc.run("serve", "tiny-llama", "--name", unique_name, "--gpus", "2", "--dry-run").stdout
    assert "#SBATCH --gres=gpu:2" in out
    assert f"#SBATCH --job-name=xhpc-{unique_name}-0" in out
    assert "#SBATCH --partition=gpu" in out
    assert "-m xhpc.agent" in out
    assert xhpc.my_jobs() == []
    assert xhpc.json("ps", "--all") == []


def test_unknown_targets(xhpc: Xhpc) -> None:
    for args in (["stop", "nothing-here"], ["logs", "nothing-here-0"]):
        proc = xhpc.run(*args, check=False)
        assert proc.returncode == 3, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
