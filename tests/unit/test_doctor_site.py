"""`xhpc doctor --site`: every check's verdict from Slurm output captured on the dev cluster
(tests/data/slurm/), with the runner faked at its one seam. The node job's "sbatch" runs the real
node check (xhpc.sitecheck.node) in a thread, against the command's own stand-in agent port."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import shlex
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from xhpc import runner
from xhpc.cli.context import Ctx
from xhpc.cli.observe.doctor import doctor
from xhpc.models import EngineKind, NodeInfo, PartitionInfo
from xhpc.settings import BrokerConfig, EngineConfig, SlurmConfig, XhpcConfig
from xhpc.sitecheck import node as node_job
from xhpc.sitecheck import run as site_run
from xhpc.sitecheck.verdicts import (
    ConnectSeen,
    NodeReport,
    NodeWindow,
    NvmlSeen,
    PathSeen,
    SiteCheck,
    Verdict,
    accounting_check,
    exit_code,
    gres_check,
    node_checks,
    node_job_script,
    parse_node_report,
    partition_check,
    slurm_check,
)
from xhpc.slurm.partitions import parse_partitions, parse_scontrol_config
from xhpc.slurm.text import parse_sinfo_text

Output = Callable[[str], str]
NAMES = [
    "slurm",
    "gres",
    "partition",
    "accounting",
    "engine:transformers",
    "engine:vllm",
    "agent-port",
    "state-dir",
    "nvml",
    "clock",
]


class FakeSite:
    """Answers each command as the dev cluster did (captured output); switches break one part."""

    def __init__(self, output: Output) -> None:
        self.output = output
        self.calls: list[list[str]] = []
        self.sacct_down = False
        self.no_json = False
        self.hang_version = False
        self.job_id = "42"
        self.job_runs = True  # "sbatch" runs the node check at once
        self.imports: dict[str, str | None] = {}  # python -> version (None: import fails)

    def _done(self, argv: list[str], stdout: str) -> runner.Completed:
        return runner.Completed(argv, 0, stdout, "")

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        env: Any = None,
        check: bool = True,
        stdin: str | None = None,
    ) -> runner.Completed:
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        name, rest = Path(argv[0]).name, argv[1:]
        if name == "sinfo" and rest == ["--version"]:
            if self.hang_version:
                await asyncio.sleep(30)
            return self._done(argv, self.output("sinfo-version.txt"))
        if name == "sinfo" and rest == ["--json"]:
            if self.no_json:
                why = "sinfo: error: --json is not supported by this build"
                raise runner.CommandFailed(argv, 1, "", why, "exit 1")
            return self._done(argv, self.output("sinfo-nodes.json"))
        if name == "sinfo":
            return self._done(argv, self.output("sinfo-nodes.txt"))
        if name == "scontrol" and "partition" in rest:
            return self._done(argv, self.output("scontrol-show-partition.txt"))
        if name == "scontrol" and rest == ["show", "config"]:
            return self._done(argv, self.output("scontrol-show-config-slurmdbd.txt"))
        if name == "scontrol":
            return self._done(argv, self.output("scontrol-show-job.txt"))
        if name == "squeue":
            return self._done(argv, self.output("squeue-jobs.txt"))
        if name == "sacct":
            if self.sacct_down:
                stderr = self.output("sacct-slurmdbd-down.txt")
                raise runner.CommandFailed(argv, 1, "", stderr, "exit 1")
            return self._done(argv, "")
        if name == "sbatch":
            if self.job_runs:
                await asyncio.to_thread(_run_job, Path(argv[-1]))
            return self._done(argv, f"{self.job_id}\n")
        if name == "scancel":
            return self._done(argv, "")
        if rest[:1] == ["-c"] and argv[0] in self.imports:
            version = self.imports[argv[0]]
            if version is None:
                why = "ModuleNotFoundError: No module named 'transformers'"
                raise runner.CommandFailed(argv, 1, "", f"Traceback ...\n{why}\n", "exit 1")
            return self._done(argv, version + "\n")
        raise AssertionError(f"unexpected command {argv}")


def _run_job(script: Path) -> None:
    """What Slurm would do with the node job's script: run its last line, output to the file."""
    lines = script.read_text().splitlines()
    output = next(ln.split("=", 1)[1] for ln in lines if ln.startswith("#SBATCH --output="))
    argv = shlex.split(lines[-1].removeprefix("exec "))
    assert argv[1:4] == ["-I", "-m", "xhpc.sitecheck.node"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        node_job.main(argv[4:])
    Path(shlex.split(output)[0]).write_text(out.getvalue())


def _fake_pynvml(works: bool) -> types.ModuleType:
    lib = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init() -> None:
        if not works:
            raise NVMLError("NVML Shared Library Not Found")

    lib.NVMLError = NVMLError  # type: ignore[attr-defined]
    lib.nvmlInit = init  # type: ignore[attr-defined]
    lib.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    lib.nvmlDeviceGetCount = lambda: 4  # type: ignore[attr-defined]
    lib.nvmlSystemGetDriverVersion = lambda: "550.54.15"  # type: ignore[attr-defined]
    return lib


@pytest.fixture
def site(
    slurm_output: Output, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[FakeSite]:
    fake = FakeSite(slurm_output)
    monkeypatch.setattr(runner, "run", fake.run)
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _fake_pynvml(works=False))
    monkeypatch.setattr(site_run, "OUTPUT_GRACE_S", 0.0)
    yield fake


@pytest.fixture
def config(tmp_path: Path, site: FakeSite) -> XhpcConfig:
    pythons = {}
    for engine in ("transformers", "vllm"):
        python = tmp_path / "venvs" / engine / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.touch()
        site.imports[str(python)] = {"transformers": "4.57.1", "vllm": "0.11.0"}[engine]
        pythons[EngineKind(engine)] = EngineConfig(python=python)
    return XhpcConfig(
        state_dir=tmp_path / "state",
        default_engine=EngineKind.TRANSFORMERS,
        slurm=SlurmConfig(partition="gpu"),
        broker=BrokerConfig(agent_bind="127.0.0.1"),
        engines=pythons,
    )


def _check(config: XhpcConfig, **kw: float) -> dict[str, SiteCheck]:
    checks = asyncio.run(site_run.run_site_checks(config, **kw))
    assert [c.name for c in checks] == NAMES  # every check answers, in a fixed order
    return {c.name: c for c in checks}


def test_a_healthy_site_is_ok_everywhere_but_nvml_on_fake_gpus(config: XhpcConfig) -> None:
    checks = _check(config)
    assert {n for n, c in checks.items() if c.verdict is not Verdict.OK} == {"nvml"}
    assert checks["nvml"].detail.startswith("no NVML on node n1 (fake GPUs?)")
    assert checks["slurm"].detail.startswith("Slurm 22.05.8")
    assert checks["gres"].detail == "12 GPUs (gpu) on 3 of 3 nodes in partition gpu"
    assert "gpu* (xhpc's): UP, nodes n[1-3], MaxTime 1-00:00:00" in checks["partition"].detail
    assert "cluster xhpcdev" in checks["accounting"].detail
    assert "imports vllm 0.11.0" in checks["engine:vllm"].detail
    assert "node n1 reaches the agent port on 127.0.0.1" in checks["agent-port"].detail
    assert checks["state-dir"].detail == f"node n1 reads and writes {config.resolved_state_dir}"
    assert "against the login node's answer" in checks["clock"].detail
    assert exit_code(list(checks.values())) == 0
    assert not (config.resolved_state_dir / "doctor").exists() or not any(
        (config.resolved_state_dir / "doctor").iterdir()
    )  # the job's directory is gone


def test_nvml_on_a_gpu_node_is_ok(config: XhpcConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _fake_pynvml(works=True))
    assert _check(config)["nvml"] == SiteCheck(
        name="nvml", verdict=Verdict.OK, detail="node n1: 4 GPU(s), driver 550.54.15"
    )


def test_slurmdbd_down_fails_accounting_alone(config: XhpcConfig, site: FakeSite) -> None:
    site.sacct_down = True
    checks = _check(config)
    bad = {n for n, c in checks.items() if c.verdict is Verdict.FAIL}
    assert bad == {"accounting"}
    assert "Problem talking to the database: Connection refused" in checks["accounting"].detail
    assert "is slurmdbd running" in checks["accounting"].detail
    assert exit_code(list(checks.values())) == 1


def test_a_missing_engine_env_fails_its_line(config: XhpcConfig, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "python"
    engines = {**config.engines, EngineKind.VLLM: EngineConfig(python=missing)}
    checks = _check(config.model_copy(update={"engines": engines}))
    assert checks["engine:vllm"].verdict is Verdict.FAIL
    assert f"its Python {missing} does not exist" in checks["engine:vllm"].detail
    assert "scripts/setup-engines vllm" in checks["engine:vllm"].detail
    assert checks["engine:transformers"].verdict is Verdict.OK


def test_an_engine_env_without_its_package_fails(config: XhpcConfig, site: FakeSite) -> None:
    python = str(config.engine(EngineKind.TRANSFORMERS).python)
    site.imports[python] = None
    detail = _check(config)["engine:transformers"].detail
    assert detail.startswith(f"{python} cannot import transformers: ModuleNotFoundError")


def test_no_json_output_is_a_warning(config: XhpcConfig, site: FakeSite) -> None:
    site.no_json = True
    check = _check(config)["slurm"]
    assert check.verdict is Verdict.WARN and "--json is not supported" in check.detail


def test_a_hanging_check_times_out_alone(config: XhpcConfig, site: FakeSite) -> None:
    site.hang_version = True
    checks = _check(config, timeout_s=0.5)
    assert checks["slurm"] == SiteCheck(
        name="slurm", verdict=Verdict.FAIL, detail="timed out after 0.5 s"
    )
    assert checks["gres"].verdict is Verdict.OK


def test_a_node_job_that_never_reports_is_cancelled(config: XhpcConfig, site: FakeSite) -> None:
    site.job_runs, site.job_id = False, "8"  # RUNNING in the capture, and never reports
    checks = _check(config, job_timeout_s=1.0)
    for name in ("agent-port", "state-dir", "nvml", "clock"):
        assert checks[name].verdict is Verdict.WARN
        assert checks[name].detail.startswith("not checked: job 8 still RUNNING")
    assert ["scancel", "8"] in [[Path(a[0]).name, *a[1:]] for a in site.calls]


def test_a_job_that_ended_without_output_blames_the_state_dir(
    config: XhpcConfig, site: FakeSite
) -> None:
    site.job_runs, site.job_id = False, "3"  # FAILED in the capture
    checks = _check(config)
    assert checks["state-dir"].verdict is Verdict.FAIL
    assert "job 3 ended FAILED and its output" in checks["state-dir"].detail
    assert "do the compute nodes mount it?" in checks["state-dir"].detail
    assert checks["agent-port"].verdict is Verdict.WARN


def test_the_running_broker_s_agent_port_is_the_target(config: XhpcConfig, site: FakeSite) -> None:
    async def both() -> dict[str, SiteCheck]:
        server = await asyncio.start_server(site_run._answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        state = config.resolved_state_dir
        state.mkdir(parents=True)
        (state / "broker.json").write_text(json.dumps({"agent_url": f"http://127.0.0.1:{port}"}))
        try:
            checks = await site_run.run_site_checks(config)
        finally:
            server.close()
        return {c.name: c for c in checks}

    detail = asyncio.run(both())["agent-port"].detail
    assert detail.startswith("node n1 reaches the broker's agent API (127.0.0.1:")


# -- the verdicts alone, from captured and hand-made input -------------------------------------


def test_slurm_versions(slurm_output: Output) -> None:
    assert slurm_check(slurm_output("sinfo-version.txt"), None).verdict is Verdict.OK
    old = slurm_check("slurm 21.08.5", None)
    assert old.verdict is Verdict.WARN and "older than 22.05" in old.detail
    assert slurm_check("what?", None).verdict is Verdict.FAIL


def test_gres_verdicts(slurm_output: Output) -> None:
    nodes = parse_sinfo_text(slurm_output("sinfo-nodes.txt"))
    assert gres_check(nodes, "urgent").verdict is Verdict.OK
    assert gres_check(nodes, "cpu").detail == "no nodes in partition cpu"
    bare = [NodeInfo(name="c1", address="c1", state="IDLE", partitions=("gpu",))]
    no_gres = gres_check(bare, "gpu")
    assert no_gres.verdict is Verdict.FAIL and "GresTypes=gpu" in no_gres.detail
    some = gres_check([*nodes, *bare], "gpu")
    assert some.verdict is Verdict.WARN and some.detail.endswith("no GPU GRES on c1")


def test_partition_verdicts(slurm_output: Output) -> None:
    parts = parse_partitions(slurm_output("scontrol-show-partition.txt"))
    assert partition_check(parts, None, "00:30:00").verdict is Verdict.OK  # Slurm's default
    gone = partition_check(parts, "a100", "00:30:00")
    assert gone.verdict is Verdict.FAIL and "'a100' does not exist" in gone.detail
    long = partition_check(parts, "gpu", "3-00:00:00")
    assert long.verdict is Verdict.FAIL and "longer than MaxTime 1-00:00:00" in long.detail
    down = [PartitionInfo(name="gpu", state="DOWN", nodes="n1", default=True)]
    assert partition_check(down, "gpu", "01:00:00").detail.startswith("partition gpu is DOWN")
    assert partition_check([], "gpu", "01:00:00").verdict is Verdict.FAIL


def test_accounting_off_is_a_warning(slurm_output: Output) -> None:
    conf = parse_scontrol_config(slurm_output("scontrol-show-config.txt"))
    check = accounting_check(conf.get("AccountingStorageType"), None, None)
    assert check.verdict is Verdict.WARN
    assert "accounting off (AccountingStorageType=accounting_storage/none)" in check.detail


def _report(**kw: Any) -> NodeReport:
    base: dict[str, Any] = {
        "node": "n2",
        "time_s": 1000.0,
        "connect": ConnectSeen(
            target="10.77.0.1:4000", ok=True, server_time_s=1000.0, local_time_s=1000.4
        ),
        "paths": (PathSeen(path="/s", exists=True, is_dir=True, readable=True, writable=True),),
        "nvml": NvmlSeen(ok=False, error="NVML cannot start"),
    }
    return NodeReport(**{**base, **kw})


def _rows(report: NodeReport, **kw: Any) -> dict[str, SiteCheck]:
    window = NodeWindow(submitted_s=998.0, read_s=1003.0)
    rows = node_checks(report, why_none="", target_label="X", state_dir="/s", window=window, **kw)
    return {r.name: r for r in rows}


def test_node_verdicts() -> None:
    rows = _rows(_report())
    assert [r.verdict for r in rows.values()] == [Verdict.OK, Verdict.OK, Verdict.WARN, Verdict.OK]
    refused = ConnectSeen(target="10.77.0.1:4000", ok=False, error="Connection refused")
    port = _rows(_report(connect=refused))
    assert port["agent-port"].verdict is Verdict.FAIL
    assert "node n2 cannot reach X (10.77.0.1:4000: Connection refused)" in (
        port["agent-port"].detail
    )
    assert "within the job's run" in port["clock"].detail  # no answer: the coarse bound
    unseen = _rows(_report(paths=(PathSeen(path="/s", exists=False),)))["state-dir"]
    assert unseen.verdict is Verdict.FAIL and "does not see state_dir /s" in unseen.detail
    read_only = PathSeen(path="/s", exists=True, is_dir=True, readable=True)
    assert _rows(_report(paths=(read_only,)))["state-dir"].verdict is Verdict.FAIL


def test_a_skewed_clock_warns() -> None:
    ahead = ConnectSeen(target="h:1", ok=True, server_time_s=1000.0, local_time_s=1009.0)
    clock = _rows(_report(connect=ahead))["clock"]
    assert clock.verdict is Verdict.WARN and "+9.0 s" in clock.detail and "NTP" in clock.detail
    behind = _rows(_report(connect=None, time_s=980.0))["clock"]  # before it was submitted
    assert behind.verdict is Verdict.WARN and "-18.0 s" in behind.detail


def test_the_node_report_line_round_trips_and_junk_is_none() -> None:
    report = _report()
    text = "some warning\nxhpc-doctor-report " + report.model_dump_json() + "\n"
    assert parse_node_report(text) == report
    assert parse_node_report("xhpc-doctor-report {not json") is None
    assert parse_node_report("") is None


def test_the_node_job_script_quotes_hostile_paths() -> None:
    hostile = "/tmp/a'; echo foo\nb"
    text = node_job_script(
        python="/opt/x y/python",
        output=Path("/s/out"),
        partition="gpu",
        account=None,
        connect="h:1",
        paths=[hostile],
    )
    exec_line = text.rpartition("\nexec ")[2]
    assert shlex.split(exec_line)[-1] == hostile
    assert shlex.split(exec_line)[:3] == ["/opt/x y/python", "-I", "-m"]
    assert "#SBATCH --partition=gpu" in text and "--account" not in text


@pytest.mark.adversarial
def test_the_node_job_script_puts_nothing_unlisted_on_an_sbatch_line() -> None:
    """Failed on ed064c8 before the fix: the doctor's job shell-quoted its partition, account
    and output path onto #SBATCH lines, which Slurm's parser does not read as a shell does."""
    for field, value in (("partition", "gpu\\' --export=ALL #"), ("account", "a b"),
                         ("output", Path("/s/o u't"))):  # fmt: skip
        kwargs: dict[str, Any] = {"python": "/p", "output": Path("/s/out"), "partition": None,
                                  "account": None, "connect": None, "paths": []}  # fmt: skip
        kwargs[field] = value
        with pytest.raises(ValueError, match="invalid"):
            node_job_script(**kwargs)


# -- the command ------------------------------------------------------------------------------


def test_doctor_site_prints_one_line_per_check_and_json(config: XhpcConfig, site: FakeSite) -> None:
    ctx = Ctx(config=config, sources=[])
    result = CliRunner().invoke(doctor, ["--site"], obj=ctx)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == len(NAMES)
    assert lines[8].split()[:2] == ["warn", "nvml"]
    site.sacct_down = True
    result = CliRunner().invoke(doctor, ["--site", "--json"], obj=ctx)
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert [d["name"] for d in data] == NAMES
    assert {d["name"]: d["verdict"] for d in data}["accounting"] == "fail"


def test_doctor_site_refuses_orphan_options(config: XhpcConfig) -> None:
    result = CliRunner().invoke(doctor, ["--site", "--fix"], obj=Ctx(config=config, sources=[]))
    assert result.exit_code == 2 and "--site runs the site checks only" in result.output
