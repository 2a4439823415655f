"""sbatch rendering: a golden file, hostile strings that must stay shell-safe, StrictUndefined.

To regenerate the golden file after an intended template change, run with UPDATE_GOLDEN=1 and
review the diff by eye.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import jinja2
import pytest
from pydantic import ValidationError

from xhpc.render import SbatchParams, render_sbatch

GOLDEN_PARAMS: dict[str, Any] = {
    "replica_id": "tiny-llama-0",
    "deployment": "tiny-llama",
    "job_name": "xhpc-tiny-llama-0",
    "comment": "xhpc:tiny-llama:tiny-llama-0",
    "gpus": 2,
    "gpu_type": "a100",
    "partition": "gpu",
    "account": "proj42",
    "time": "02:00:00",
    "nodelist": "n1",
    "cpus": 4,
    "mem_mb": 16000,
    "output": "/srv/xhpc/state/replicas/tiny-llama-0/slurm-%j.out",
    "agent_python": "/opt/xhpc/.venv/bin/python",
    "replica_dir": "/srv/xhpc/state/replicas/tiny-llama-0",
}
MINIMAL_PARAMS: dict[str, Any] = {
    **{k: GOLDEN_PARAMS[k] for k in ("replica_id", "deployment", "job_name", "comment", "time")},
    "gpus": 0,
    "output": "/tmp/out-%j.log",
    "agent_python": "/usr/bin/python3",
    "replica_dir": "/tmp/r",
}

HOSTILE = [
    "'; echo pwned",
    "$(id)",
    "`id`",
    "a b  c",
    "\"double\" and 'single'",
    "x;rm -rf ~ &",
    "back\\slash",
    "$HOME/${USER}",
    "-n",
    "#not-a-comment",
    "*?[glob]",
    "ünï €",
]
NOT_ONE_LINE = [
    "a\nb",
    "a\rb",
    "x\n#SBATCH --gres=gpu:8",
    "/tmp/x\ntouch pwned #",
    "a\x00b",
    "tab\there",
    "esc\x1b[31m",
    "ls\u2028sep",
]


def _exec_line(script: str) -> str:
    (line,) = [ln for ln in script.splitlines() if ln.startswith("exec ")]
    return line


def _command_lines(script: str) -> list[str]:
    """Lines bash would run (not comments, not blank)."""
    return [ln for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _sbatch_options(script: str) -> list[list[str]]:
    return [
        shlex.split(ln[len("#SBATCH ") :])
        for ln in script.splitlines()
        if ln.startswith("#SBATCH ")
    ]


def test_golden_serve_sbatch(golden_dir: Path) -> None:
    script = render_sbatch(SbatchParams(**GOLDEN_PARAMS))
    golden = golden_dir / "serve.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()


def test_golden_script_structure() -> None:
    script = render_sbatch(SbatchParams(**GOLDEN_PARAMS))
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert script.endswith("\n")
    assert _command_lines(script) == [
        "exec /opt/xhpc/.venv/bin/python -I -m xhpc.agent /srv/xhpc/state/replicas/tiny-llama-0"
    ]
    # Every #SBATCH directive comes before the first command (sbatch stops reading after it).
    last_directive = max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    assert last_directive < lines.index(_exec_line(script))
    opts = dict([*o[0].split("=", 1), ""][:2] for o in _sbatch_options(script))
    assert opts["--gres"] == "gpu:a100:2"
    assert "--requeue" in opts  # the job states its requeue policy
    assert opts["--mem"] == "16000M"
    assert opts["--output"] == GOLDEN_PARAMS["output"]
    assert opts["--signal"] == "B:USR1@60"


def test_minimal_params_leave_out_optional_directives() -> None:
    script = render_sbatch(SbatchParams(**MINIMAL_PARAMS))
    names = {o[0].split("=", 1)[0] for o in _sbatch_options(script)}
    assert names == {
        "--job-name",
        "--comment",
        "--nodes",
        "--ntasks",
        "--cpus-per-task",
        "--time",
        "--output",
        "--open-mode",
        "--signal",
        "--requeue",
    }
    assert "None" not in script
    assert _command_lines(script) == ["exec /usr/bin/python3 -I -m xhpc.agent /tmp/r"]


SBATCH_FIELDS = ["output", "agent_python", "replica_dir", "job_name", "comment", "partition",
                 "account", "nodelist", "time", "gpu_type"]  # fmt: skip


@pytest.mark.adversarial
@pytest.mark.parametrize("field", SBATCH_FIELDS)
@pytest.mark.parametrize("value", HOSTILE + NOT_ONE_LINE)
def test_hostile_values_are_refused_in_every_field_before_a_script_exists(
    field: str, value: str
) -> None:
    """Failed on 6d94085 before the fix: quotes, backslashes, blanks, '#' and leading '-' were
    shell-quoted onto #SBATCH lines, which Slurm's parser reads on its own terms (a backslash
    inside quotes is honoured), so a value could add sbatch options to the job."""
    tried = [value]
    if field in ("output", "agent_python", "replica_dir") and value != "-n":
        tried.append(f"/tmp/{value}/x")  # inside an absolute path ("/tmp/-n/x" is a fine one)
    for bad in tried:
        with pytest.raises(ValidationError, match="invalid"):
            SbatchParams(**{**MINIMAL_PARAMS, field: bad})


@pytest.mark.adversarial
def test_the_sbatch_filter_refuses_what_validation_was_skipped_for() -> None:
    """Defence in depth: params built without validation still put nothing unlisted on an
    #SBATCH line, however it is quoted."""
    for field, value in [("partition", "gpu' --export=ALL #"), ("comment", "x\\' --qos=hi"),
                         ("time", "-1"), ("output", "/x\ntouch pwned #")]:  # fmt: skip
        params = SbatchParams.model_construct(**{**MINIMAL_PARAMS, field: value})
        with pytest.raises(ValueError, match="#SBATCH line"):
            render_sbatch(params)


def test_every_sbatch_value_stands_bare_on_its_line() -> None:
    """What Slurm reads is exactly the value: no quotes for its parser to interpret."""
    script = render_sbatch(SbatchParams(**GOLDEN_PARAMS))
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            assert "'" not in line and '"' not in line and "\\" not in line, line


def test_extra_and_invalid_params_are_refused() -> None:
    with pytest.raises(ValidationError):
        SbatchParams(**{**MINIMAL_PARAMS, "token": "s3cret"})
    with pytest.raises(ValidationError):
        SbatchParams(**{**MINIMAL_PARAMS, "gpus": -1})
    with pytest.raises(ValidationError):
        SbatchParams(**{**MINIMAL_PARAMS, "cpus": 0})


def test_strict_undefined_missing_variable_raises(tmp_path: Path) -> None:
    (tmp_path / "t.j2").write_text("#!/bin/bash\nexec {{ agent_python | q }} {{ not_a_param }}\n")
    with pytest.raises(jinja2.UndefinedError, match="not_a_param"):
        render_sbatch(SbatchParams(**MINIMAL_PARAMS), tmp_path, "t.j2")


def test_custom_template_dir_and_quote_filter(tmp_path: Path) -> None:
    (tmp_path / "t.j2").write_text("run {{ replica_dir | q }} {{ deployment | q }} {{ gres }}\n")
    params = SbatchParams(**{**MINIMAL_PARAMS, "deployment": "a b"})
    assert render_sbatch(params, tmp_path, "t.j2") == "run /tmp/r 'a b' gpu:0\n"


@pytest.mark.adversarial
def test_a_time_limit_in_other_digits_is_refused_by_the_model() -> None:
    """Failed before the fix: the time rule's ``\\d`` took any script's digits; the renderer's
    second wall refused what the model had let through."""
    for time in ("\u0661\u0660\u0660\u0660", "\uff11:00", "1-\u0660\u0660:00"):
        with pytest.raises(ValidationError):
            SbatchParams(**{**MINIMAL_PARAMS, "time": time})
