"""bench/launch.py's pure parts, without a cluster: the table and its two targets from recorded
figures (bench/_launch/table.py), the job rendering and the check that the three jobs agree
(bench/_launch/engine.py, bench/_launch/vecinf.py), what the poll loop reads back from Slurm,
vec-inf and the jobs (squeue and sinfo lines, vec-inf's JSON, vLLM's log line), the command
line, and (marked ``bench``: it runs .venvs/vec-inf, which scripts/setup-bench installs) the
offline ``--dry-run`` that renders all three jobs through vec-inf and xhpc's planner.

The benchmark itself runs on the dev cluster (`.venv/bin/python bench/launch.py`); nothing here
submits a job, or starts a broker, a proxy or an engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench._launch import cluster, contenders, engine, measure, table, vecinf
from bench._launch.contenders import Launch, Run
from bench._launch.params import RESOURCES

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "launch.py"
FIRST_200 = "**first 200 (launch -> first answer)**"


def _run(key: str, rnd: int, submit: float, running: float, first: float | None,
         error: str | None = None) -> dict[str, Any]:  # fmt: skip
    """A run as the benchmark records it."""
    return {
        "contender": key, "round": rnd, "slot": 0, "job_name": f"{key}-{rnd}",
        "job_id": str(100 + rnd), "node": "n1", "submit_s": submit, "running_s": running,
        "first_200_s": first, "error": error, "left_jobs": [],
    }  # fmt: skip


def _rounds(xhpc: list[float], plain: list[float], vec_inf: list[float]) -> list[dict[str, Any]]:
    runs = [_run("plain", -1, 0.02, 0.1, 30.0)]  # the warm-up: in no figure
    for rnd, (x, p, v) in enumerate(zip(xhpc, plain, vec_inf, strict=True)):
        runs += [
            _run("plain", rnd, 0.02, 0.10, p),
            _run("vec-inf", rnd, 1.10, 0.90, v),  # RUNNING before the command returned
            _run("xhpc", rnd, 0.70, 0.80, x),
        ]
    return runs


def _targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = table.targets(runs)
    assert [t["target"] for t in found] == [table.TARGET_PLAIN, table.TARGET_VEC_INF]
    assert all(set(t) == {"target", "value", "met"} and isinstance(t["met"], bool) for t in found)
    return found


def _row(text: str, label: str) -> str:
    (row,) = [ln for ln in text.splitlines() if ln.startswith(f"| {label} |")]
    return row


def test_the_table_and_both_targets_met_from_recorded_figures() -> None:
    runs = _rounds(xhpc=[10.3, 10.9, 10.1], plain=[10.0, 10.5, 9.8], vec_inf=[13.0, 12.6, 13.4])
    summary = table.summarize(runs, {"rounds": 3, "poll_s": 0.05, "vec_inf": "0.9.0"})
    text = summary.text
    header = text.splitlines()[4]
    assert header.startswith("| phase") and "| vec-inf launch - plain sbatch |" in header
    first = _row(text, FIRST_200)
    assert first.count("|") == header.count("|")
    # plain, vec-inf, xhpc, vec-inf - plain, xhpc - plain: median [min, max]
    assert "| 10.00 [9.80, 10.50] | 13.00 [12.60, 13.40] | 10.30 [10.10, 10.90] |" in first
    assert "| +3.00 [+2.10, +3.60] | +0.30 [+0.30, +0.40] |" in first
    assert "| 1.10 [1.10, 1.10] |" in _row(text, "launch command returned")
    assert _row(text, "answered").startswith("| answered | 3/3 | 3/3 | 3/3 |")  # warm-up left out
    vs_plain, vs_vec_inf = _targets(runs)
    assert vs_plain["met"] and vs_plain["value"].startswith("+0.30 s")
    assert vs_vec_inf["met"] and vs_vec_inf["value"].startswith("-2.70 s")
    data = summary.data
    assert data["targets"] == [vs_plain, vs_vec_inf]
    assert data["median_s"]["xhpc"]["first_200_s"] == pytest.approx(10.3)
    assert data["diff_to_plain_s"]["xhpc"]["first_200_s"] == pytest.approx(0.3)
    assert data["answered"] == {"plain": [3, 3], "vec-inf": [3, 3], "xhpc": [3, 3]}
    json.dumps(data, allow_nan=False)  # what --json writes
    assert "did not answer" not in text


def test_each_target_fails_on_its_own_figure() -> None:
    slow = _rounds(xhpc=[10.9, 11.2, 10.5], plain=[10.0, 10.5, 9.8], vec_inf=[13.0, 12.6, 13.4])
    vs_plain, vs_vec_inf = _targets(slow)
    assert not vs_plain["met"] and vs_plain["value"].startswith("+0.70 s")
    assert vs_vec_inf["met"]
    behind = _rounds(xhpc=[10.3, 10.9, 10.1], plain=[10.0, 10.5, 9.8], vec_inf=[10.0, 10.9, 10.0])
    vs_plain, vs_vec_inf = _targets(behind)
    assert vs_plain["met"] and not vs_vec_inf["met"]  # a tie is not ahead
    assert vs_vec_inf["value"].startswith("+0.10 s")
    summary = table.summarize(behind, {})
    assert "| xhpc ahead of vec-inf (median) | +0.10 s" in summary.text
    assert summary.text.rstrip().endswith("| **no** |")


def test_a_failed_run_is_in_no_figure_and_listed_under_the_table() -> None:
    runs = _rounds(xhpc=[10.3, 10.9, 10.1], plain=[10.0, 10.5, 9.8], vec_inf=[13.0, 12.6, 13.4])
    failed = next(r for r in runs if r["contender"] == "vec-inf" and r["round"] == 1)
    failed.update(first_200_s=None, error="the job ended (FAILED) before it answered")
    runs[0].update(error="no answer within 600 s", first_200_s=None)  # the warm-up
    summary = table.summarize(runs, {})
    assert _row(summary.text, "answered").startswith("| answered | 3/3 | 2/3 | 3/3 |")
    assert "| 13.20 [13.00, 13.40] |" in _row(summary.text, FIRST_200)  # rounds 0 and 2
    _, vs_vec_inf = table.targets(runs)
    assert "median of 2 rounds" in vs_vec_inf["value"]
    lines = summary.text.splitlines()
    assert "- round 1, vec-inf launch (job 101): the job ended (FAILED) before it answered" in lines
    assert "- warm-up, plain sbatch (job 99): no answer within 600 s" in lines


def test_no_figures_meet_no_target() -> None:
    only_plain = [r for r in _rounds([1.0], [1.0], [1.0]) if r["contender"] == "plain"]
    found = _targets(only_plain)
    assert [t["met"] for t in found] == [False, False]
    assert all(t["value"].startswith("not measured") for t in found)
    summary = table.summarize(only_plain, {})
    assert "| - | - |" in _row(summary.text, FIRST_200)
    json.dumps(summary.data, allow_nan=False)


def test_rounds_rotate_the_order() -> None:
    keys = ["plain", "vec-inf", "xhpc"]
    orders = [measure.rotated(keys, r) for r in range(4)]
    assert orders[1] == ["vec-inf", "xhpc", "plain"] and orders[3] == orders[0] == keys
    assert {o[0] for o in orders[:3]} == set(keys)  # each goes first once in three rounds


# --- the three jobs -------------------------------------------------------------------------


def _command(tmp_path: Path) -> engine.VllmCommand:
    """The vLLM command for a stand-in of the tiny model (its config.json only: the quick tier
    runs before scripts/make-tiny-model has made the real one)."""
    user = tmp_path / "user.toml"
    user.write_text(engine.user_toml(RESOURCES))
    staged = tmp_path / "models" / "tiny-llama"
    staged.mkdir(parents=True)
    (staged / "config.json").write_text("{}")
    config = engine.xhpc_config(user, tmp_path / "state", models_dir=staged.parent)
    _, spec = engine.xhpc_plan(config, "lb-test", RESOURCES)
    return engine.vllm_command(spec, tmp_path / "jobs")


def test_the_vllm_command_is_xhpcs_own(tmp_path: Path) -> None:
    cmd = _command(tmp_path)
    site = ("--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", "67108864",
            "--dtype", "float32")  # fmt: skip
    assert cmd.args == site
    argv = cmd.module_argv("m", engine.PORT_SH)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--served-model-name") + 1] == "m"
    assert argv[argv.index("--port") + 1] == "$PORT"
    serve = cmd.serve_argv("m", "8000")
    assert serve[0].endswith("/vllm") and serve[1:3] == ["serve", cmd.model_path]
    assert tuple(serve[serve.index("--port") + 2 :]) == site
    env = dict(cmd.env)
    assert env["OMP_NUM_THREADS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_HOST_IP"] == engine.NODE_ADDR_SH
    assert env["VLLM_CACHE_ROOT"] == f"{tmp_path}/jobs/$SLURM_JOB_ID/vllm-cache"
    assert "VLLM_API_KEY" not in env
    exec_line = engine.exec_line(argv)
    assert ' --port "$PORT" ' in exec_line and exec_line.startswith("exec /")


def test_job_values_must_survive_an_unquoted_export() -> None:
    assert engine.job_value(engine.NODE_ADDR_SH) == engine.NODE_ADDR_SH
    assert engine.job_value("/tmp/w/jobs/$SLURM_JOB_ID/x") == "/tmp/w/jobs/$SLURM_JOB_ID/x"
    for bad in ("a b", "x;rm", "$(id)", '"q"', "$HOME"):
        with pytest.raises(ValueError):
            engine.job_value(bad)


def test_sbatch_resources_are_normalised() -> None:
    vec_inf = "#SBATCH --gres=gpu:1\n#SBATCH --mem=4G\n#SBATCH --nodes=1\n#SBATCH --time=00:30:00"
    xhpc = "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n#SBATCH --mem=4096M\n#SBATCH --gres=gpu:1\n"
    xhpc += "#SBATCH --time=00:30:00\n#SBATCH --requeue\n#SBATCH --job-name=x"
    assert engine.sbatch_resources(vec_inf) == engine.sbatch_resources(xhpc) == {
        "nodes": "1", "ntasks": "1", "gres": "gpu:1", "mem": "4096M", "time": "00:30:00",
    }  # fmt: skip
    assert engine.mem_mb("4096") == 4096 and engine.mem_mb("1T") == 1024 * 1024


def test_the_parity_check_names_each_difference() -> None:
    res = {"gres": "gpu:1", "mem": "4096M"}
    call = engine.EngineCall("/m", ("--dtype", "float32"), {"OMP_NUM_THREADS": "1"})
    same = {"plain": res, "vec-inf": dict(res), "xhpc": dict(res)}
    calls = {"plain": call, "vec-inf": call, "xhpc": call}
    assert engine.parity_problems(same, calls) == []
    other = engine.EngineCall("/m", ("--dtype", "bfloat16"), {"OMP_NUM_THREADS": "2"})
    problems = engine.parity_problems(
        {**same, "vec-inf": {"gres": "gpu:l40s:1", "mem": "4096M"}}, {**calls, "xhpc": other}
    )
    assert len(problems) == 3
    assert problems[0].startswith("vec-inf: Slurm resources")
    assert problems[1].startswith("xhpc: vLLM arguments")
    assert problems[2].startswith("xhpc: engine environment")


def test_the_vec_inf_model_config_is_filled_in_whole(tmp_path: Path) -> None:
    cmd = _command(tmp_path)
    dirs = vecinf.VecInfDirs(tmp_path / "vec-inf")
    text = vecinf.models_config(dirs, "tiny-llama-7-r0", cmd, RESOURCES)
    assert "@" not in text.replace("@...@", "")
    assert '  "tiny-llama-7-r0":\n' in text
    assert 'vllm_args: {"--enforce-eager": true, "--max-model-len": "512",' in text
    assert '"SLURMD_NODENAME": "$(hostname -I | cut -d\' \' -f1)"}' in text
    assert 'time: "00:30:00"' in text and 'mem_per_node: "4G"' in text
    with pytest.raises(ValueError, match="@LATER@"):
        vecinf.fill("a: @A@\nb: @LATER@\n", {"A": 1})
    assert vecinf.vllm_args_mapping(("--x", "--y", "2", "--z", "-1")) == {
        "--x": True, "--y": "2", "--z": "-1",
    }  # fmt: skip


def test_what_the_poll_loop_reads_back(tmp_path: Path) -> None:
    rows = cluster.parse_rows("17|lb-1-r0-plain|RUNNING|n2\n18|x|PENDING|\nnoise\n")
    assert rows == [
        cluster.JobRow("17", "lb-1-r0-plain", "RUNNING", "n2"),
        cluster.JobRow("18", "x", "PENDING", ""),
    ]
    addresses = cluster.parse_addresses("n1|10.77.0.11\nn1|10.77.0.11\nn2|10.77.0.12\n")
    assert addresses == {"n1": "10.77.0.11", "n2": "10.77.0.12"}
    out = 'warning\n{"model_name": "m", "slurm_job_id": "42", "log_dir": "/x"}\n'
    assert vecinf.launched_job_id(out) == "42" and vecinf.launched_job_id("no json") is None
    dirs = vecinf.VecInfDirs(tmp_path)
    job_json = dirs.job_file("m", "42", ".json")
    assert vecinf.server_port(dirs, "m", "42") is None
    job_json.parent.mkdir(parents=True)
    job_json.write_text('{"model_name": "m"}')  # vec-inf's write came after the job's
    dirs.job_file("m", "42", ".out").write_text(
        "INFO api_server: Starting vLLM server on http://0.0.0.0:41234\n"
    )
    assert vecinf.server_port(dirs, "m", "42") == 41234
    job_json.write_text('{"server_address": "http://10.77.0.12:8123/v1"}')
    assert vecinf.server_port(dirs, "m", "42") == 8123


def test_the_command_line() -> None:
    helps = {}
    for script in ("launch.py", "submit_to_ready.py"):  # the other one shares the cluster helpers
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / script), "--help"],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        helps[script] = done.stdout
    assert "--dry-run" in helps["launch.py"] and "--xhpc-follow" in helps["launch.py"]
    done = subprocess.run(
        [sys.executable, str(BENCH), "--rounds", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--rounds must be at least 1" in done.stderr


@pytest.mark.bench  # .venvs/vec-inf renders its job (scripts/setup-bench installs it)
def test_the_dry_run_renders_three_jobs_that_agree() -> None:
    if not vecinf.VEC_INF.exists():
        pytest.skip("no .venvs/vec-inf (scripts/setup-bench)")
    if not (ROOT / "models" / "tiny-llama" / "config.json").exists():
        pytest.skip("no models/tiny-llama (scripts/make-tiny-model)")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    heads = [ln for ln in done.stdout.splitlines() if ln.startswith("# ---- ")]
    assert [h.split(":")[0] for h in heads] == ["# ---- plain", "# ---- vec-inf", "# ---- xhpc"]
    assert len({h.split(": ", 1)[1] for h in heads}) == 1  # the same resources
    assert "vllm serve " in done.stdout and "-m vllm.entrypoints.openai.api_server" in done.stdout
    assert "the three jobs differ" not in done.stderr


# --- the poll loop, against a fake squeue and server ----------------------------------------


class FakeSlurm:
    """squeue as the loop asks it (by job name): PENDING, RUNNING on n1 from ``running_at`` s
    after the first question, gone from ``gone_at``; the server answers 200 ``answer_after`` s
    after RUNNING was seen (None: never)."""

    def __init__(self, running_at: float = 0.3, gone_at: float | None = None,
                 answer_after: float | None = 0.2) -> None:  # fmt: skip
        self.running_at, self.gone_at, self.answer_after = running_at, gone_at, answer_after
        self.t0: float | None = None
        self.seen_running: float | None = None
        self.cancelled: list[str] = []

    def job_rows(self, *, job_id: str | None = None, names: Any = ()) -> list[cluster.JobRow]:
        now = time.monotonic()
        self.t0 = self.t0 or now
        if self.gone_at is not None and now - self.t0 >= self.gone_at:
            return []
        if now - self.t0 < self.running_at:
            return [cluster.JobRow("77", next(iter(names)), "PENDING", "")]
        self.seen_running = self.seen_running or now
        return [cluster.JobRow("77", next(iter(names)), "RUNNING", "n1")]

    def chat_ok(self, host: str, port: int, model: str, timeout_s: float = 10.0) -> bool:
        assert (host, port, model) == ("10.0.0.1", 8000, "m")
        if self.answer_after is None or self.seen_running is None:
            return False
        return time.monotonic() - self.seen_running >= self.answer_after


class FakeContender:
    key = "plain"

    def __init__(self, tmp: Path, code: str) -> None:
        self.tmp, self.code = tmp, code
        self.stopped: list[str] = []

    def prepare(self, tag: str) -> Launch:
        return Launch(
            key=self.key, argv=[sys.executable, "-c", self.code], env=dict(os.environ),
            cwd=self.tmp, job_name=f"fake-{tag}", served="m", stdout=self.tmp / f"{tag}.out",
            stderr=self.tmp / f"{tag}.err",
        )  # fmt: skip

    def job_id(self, launch: Launch, stdout: str) -> str | None:
        return stdout.strip() or None

    def endpoint(self, run: Run) -> tuple[str, int] | None:
        return ("10.0.0.1", 8000) if run.node else None

    def stop(self, run: Run) -> list[str]:
        self.stopped.append(run.launch.job_name)
        return []


def _follow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm: FakeSlurm, code: str,
            timeout_s: float = 30.0) -> tuple[Run, FakeContender]:  # fmt: skip
    monkeypatch.setattr(measure, "job_rows", slurm.job_rows)
    monkeypatch.setattr(measure, "chat_ok", slurm.chat_ok)
    monkeypatch.setattr(measure, "LIVENESS_S", 0.1)
    c = FakeContender(tmp_path, code)
    launches: list[Launch] = []
    run = measure.one_run(c, "t", 0, 0, timeout_s, launches)
    assert [la.job_name for la in launches] == c.stopped == ["fake-t"]  # stopped however it ends
    return run, c


def test_the_loop_times_each_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm(running_at=0.3, answer_after=0.2)
    run, _ = _follow(tmp_path, monkeypatch, slurm, "import time; time.sleep(0.2); print(77)")
    assert run.error is None, run.error
    assert run.job_id == "77" and run.node == "n1"
    assert run.submit_s is not None and run.running_s is not None and run.first_200_s is not None
    assert 0.2 <= run.submit_s < 5.0  # stamped when the command exited, not at the next look
    assert 0.3 <= run.running_s < 5.0
    assert run.first_200_s >= run.running_s + 0.2
    assert run.record()["first_200_s"] == run.first_200_s


def test_running_may_come_before_the_command_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm = FakeSlurm(running_at=0.0, answer_after=0.0)
    run, _ = _follow(tmp_path, monkeypatch, slurm, "import time; time.sleep(0.8); print(77)")
    assert run.error is None, run.error
    assert run.running_s is not None and run.submit_s is not None and run.first_200_s is not None
    assert run.running_s < run.submit_s and run.submit_s >= 0.8  # the command was not cut short
    assert run.first_200_s < run.submit_s  # an answer before the return is kept


def test_a_failed_launch_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import sys; print('boom', file=sys.stderr); sys.exit(3)"
    run, _ = _follow(tmp_path, monkeypatch, FakeSlurm(running_at=99), code)
    assert run.error is not None and "exited 3: boom" in run.error
    assert run.submit_s is not None and run.first_200_s is None
    run, _ = _follow(tmp_path, monkeypatch, FakeSlurm(running_at=99), "print('')")
    assert run.error is not None and run.error.startswith("no job id")


def test_a_job_that_ends_before_it_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm(running_at=0.0, gone_at=0.5, answer_after=None)
    run, _ = _follow(tmp_path, monkeypatch, slurm, "print(77)")
    assert run.error == "the job ended (gone from squeue) before it answered"
    assert run.running_s is not None and run.first_200_s is None


def test_a_run_past_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import time; print(77, flush=True); time.sleep(30)"  # a command that hangs
    slurm = FakeSlurm(running_at=0.0, answer_after=None)
    started = time.monotonic()
    run, _ = _follow(tmp_path, monkeypatch, slurm, code, timeout_s=1.0)
    assert time.monotonic() - started < 15  # the hanging command was stopped
    assert run.error is not None and run.error.startswith("no answer within 1 s")
    assert "command returned: no, RUNNING: yes, server address: 10.0.0.1:8000" in run.error


def test_jobs_left_are_cancelled_by_id_never_xhpcs(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[str]] = []
    cancelled: list[list[str]] = []

    def rows(*, job_id: str | None = None, names: Any = ()) -> list[cluster.JobRow]:
        asked.append(list(names))
        return [cluster.JobRow("5", "lb-1-r0-plain", "RUNNING", "n1")]

    monkeypatch.setattr(measure, "job_rows", rows)
    monkeypatch.setattr(measure, "scancel", lambda ids: cancelled.append(sorted(ids)))
    monkeypatch.setattr(measure, "wait_gone", lambda names, timeout_s: [])
    launches = [
        Launch("plain", [], {}, Path("."), "lb-1-r0-plain", "m", Path("a"), Path("b")),
        Launch("xhpc", [], {}, Path("."), "xhpc-lb-1-r0-0", "m", Path("a"), Path("b")),
        Launch("vec-inf", [], {}, Path("."), "tiny-llama-1-r0-vec-inf", "m", Path("a"), Path("b")),
    ]
    assert measure.cancel_left(launches) == []
    assert asked == [["lb-1-r0-plain", "tiny-llama-1-r0-vec-inf"]] and cancelled == [["5"]]


def test_each_contenders_launch(tmp_path: Path) -> None:
    cmd = _command(tmp_path)
    nodes = contenders.Nodes()
    plain = contenders.PlainSbatch(tmp_path, cmd, RESOURCES, nodes, vllm_serve=False)
    launch = plain.prepare("9-r1")
    assert launch.argv[:2] == ["sbatch", "--parsable"] and launch.job_name == "lb-9-r1-plain"
    script = Path(launch.argv[2]).read_text()
    assert f"#SBATCH --job-name={launch.job_name}\n" in script and "\nexec " in script
    assert "XHPC_STATE_DIR" not in launch.env and launch.env["SLURM_CONF"].endswith("slurm.conf")
    assert plain.job_id(launch, "4242;cluster\n") == "4242" and plain.job_id(launch, "") is None
    dirs = vecinf.VecInfDirs(tmp_path / "vec-inf")
    dirs.prepare()
    vec = contenders.VecInf(dirs, cmd, RESOURCES, nodes).prepare("9-r1")
    assert vec.job_name == "tiny-llama-9-r1-vec-inf" and vec.served == "tiny-llama-9-r1"
    assert vec.argv[1:] == [
        "launch", "tiny-llama-9-r1", "--config", str(dirs.models_file("tiny-llama-9-r1")),
        "--json-mode",
    ]  # fmt: skip
    assert vec.env["VEC_INF_CONFIG_DIR"] == str(dirs.config_dir)
    assert (dirs.config_dir / "environment.yaml").read_text().count("required_args: {}") == 1

    class X:
        proxy_port = 8123
        env = {"XHPC_STATE_DIR": "/tmp/s"}

        def run(self, *args: str, check: bool = True, timeout: float = 600) -> Any:
            raise AssertionError("not called here")

    for follow in (False, True):
        xhpc = contenders.XhpcServe(X(), "/bin/xhpc", tmp_path, RESOURCES, follow)
        launch = xhpc.prepare("9-r1")
        assert launch.argv[:7] == [
            "/bin/xhpc", "serve", "tiny-llama", "--name", "lb-9-r1", "--engine", "vllm",
        ]  # fmt: skip
        assert ("--detach" in launch.argv) is not follow
        assert launch.job_name == "xhpc-lb-9-r1-0" and launch.env["XHPC_STATE_DIR"] == "/tmp/s"
        view = {"name": "lb-9-r1", "replicas": [{"replica_id": "lb-9-r1-0", "job_id": "31"}]}
        assert xhpc.job_id(launch, json.dumps(view)) == "31"
        run = Run(launch=launch, round=1, slot=0)
        assert (xhpc.endpoint(run) is None) is follow  # follow: the proxy only once it returned
        run.submit_s = 1.0
        assert xhpc.endpoint(run) == ("127.0.0.1", 8123)
