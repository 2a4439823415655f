"""Properties of every job script xhpc writes: no unvalidated value reaches an ``#SBATCH`` line.

The parameter models of each script (serve, PD unit, batch, weights cache) are given hostile
text in every field. Each is either refused by its model (pydantic's ValidationError), exactly
when a hand-written reference says a field breaks its kind's rule, or rendered; a rendered
script's ``#SBATCH`` lines are exactly the options expected for those parameters, each value the
one given and within its kind's allow-list (``tests.props_support.directive_problems``), and its
shell lines split back into exactly the words given. Then the broker's own doors: a member's
``ServeRequest``, ``BatchRequest`` and an admin's ``CachePull`` with hostile fields are served
by a broker whose Slurm records each script it is asked to submit, and every recorded script
passes the same reading."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from tests.props_support import (
    HOSTILE_WORDS,
    BackgroundLoop,
    CapturingSlurm,
    directive_problems,
    directives,
    end_deployments,
    hostile_text,
    options,
)
from xhpc.access import Caller
from xhpc.batch.spec import BatchRequest
from xhpc.broker.service import BrokerService
from xhpc.errors import XhpcError
from xhpc.models import NAME_RE, ServeRequest
from xhpc.render import (
    BatchSbatchParams,
    CacheSbatchParams,
    PdSbatchParams,
    SbatchParams,
    render_batch_sbatch,
    render_cache_sbatch,
    render_pd_sbatch,
    render_sbatch,
)
from xhpc.settings import XhpcConfig
from xhpc.slurm.parse import parse_sinfo_json
from xhpc.store import Store
from xhpc.weights import CachePull

pytestmark = [pytest.mark.security, pytest.mark.adversarial]

DATA = Path(__file__).resolve().parent / "data" / "slurm"
PROPS = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# The reference: each kind's rule written out again, ASCII only, apart from xhpc.sbatch_values.
REFERENCE = {
    "name": re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII),
    "hostlist": re.compile(r"[A-Za-z0-9][A-Za-z0-9._,\[\]-]{0,200}", re.ASCII),
    "time": re.compile(
        r"([0-9]{1,4}-[0-9]{1,2}(:[0-9]{1,2}){0,2}|[0-9]{1,6}(:[0-9]{1,2}){0,2}|UNLIMITED|INFINITE)"
    ),
    "path": re.compile(r"/[A-Za-z0-9._/%@+=:,-]{0,1023}"),
    "text": re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}"),
}
# Values shaped like each kind. ``\d`` and ``\w`` take any Unicode digit or letter here, as
# they do in a regex written without re.ASCII: the reference, not the shape, says what is valid.
SHAPED = {
    "name": st.from_regex(r"\w[\w.-]{0,20}", fullmatch=True),
    "hostlist": st.from_regex(r"\w{1,6}(\[\d-\d\])?(,\w\d)?", fullmatch=True),
    "time": st.from_regex(
        r"\d{1,4}-\d{1,2}(:\d{1,2}){0,2}|\d{1,6}(:\d{1,2}){0,2}|INFINITE", fullmatch=True
    ),
    "path": st.from_regex(r"/[\w.%@+=:,-]{0,12}(/[\w.%@+=:,-]{1,12}){0,3}", fullmatch=True),
    "text": st.from_regex(r"\w[\w.:@+=-]{0,40}", fullmatch=True),
}


def passes(kind: str, value: str | None) -> bool:
    """The reference: whether ``value`` may stand on an #SBATCH line as a ``kind``."""
    if value is None:
        return True
    if kind == "path" and ".." in value.split("/"):
        return False
    return REFERENCE[kind].fullmatch(value) is not None


SHELL_WORD = st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True)  # a shell line's word
WORDS = "words"  # a field of several shell words (a tuple)


@dataclass
class Drawn:
    """Fields drawn for one parameter model: their kinds (None: a shell word) and values."""

    fields: dict[str, Any]
    kinds: dict[str, str | None]

    def broken(self) -> set[str]:
        """The reference: the fields whose value breaks its kind's rule (a shell word: that
        is not printable)."""
        bad = set()
        for name, kind in self.kinds.items():
            value = self.fields[name]
            if value is None:
                continue
            if kind is None or kind == WORDS:
                values = value if isinstance(value, tuple) else (value,)
                if not all(v.isprintable() for v in values):
                    bad.add(name)
            elif not passes(kind, value):
                bad.add(name)
        return bad


def draw_fields(draw: st.DrawFn, kinds: dict[str, str | None], optional: set[str]) -> Drawn:
    """Values shaped like their kind, but for one or two fields given hostile text; optional
    fields may be left out."""
    hostile = draw(st.sets(st.sampled_from(sorted(kinds)), max_size=2))
    fields: dict[str, Any] = {}
    for name, kind in kinds.items():
        if kind == WORDS:
            words = st.lists(hostile_text() if name in hostile else SHELL_WORD, max_size=3)
            fields[name] = tuple(draw(words))
        elif name in hostile:
            fields[name] = draw(hostile_text())
        elif name in optional and draw(st.booleans()):
            fields[name] = None
        else:
            fields[name] = draw(SHAPED[kind] if kind is not None else SHELL_WORD)
    return Drawn(fields, dict(kinds))


def build(model: type[BaseModel], drawn: Drawn, **more: Any) -> BaseModel | None:
    """``model`` made from ``drawn`` (and ``more``, valid), or None when it refused: exactly
    the fields the reference says break their rule are refused."""
    try:
        params = model(**drawn.fields, **more)
    except PydanticValidationError as err:
        refused = {str(e["loc"][0]) for e in err.errors()}
        assert refused == drawn.broken(), f"{drawn.fields!r}: {err}"
        return None
    assert drawn.broken() == set(), f"accepted, though it breaks a rule: {drawn.fields!r}"
    return params


def assert_directives(script: str, expected: list[tuple[str, str | None]]) -> None:
    assert directive_problems(script) == [], script
    assert directives(script) == expected, script


def shell_words(script: str, starts: str) -> list[list[str]]:
    return [shlex.split(ln) for ln in script.split("\n") if ln.startswith(starts)]


# -- the parameter models, rendered ---------------------------------------------------------------
SERVE_KINDS: dict[str, str | None] = {
    "replica_id": None, "deployment": None, "job_name": "text", "comment": "text",
    "gpu_type": "name", "partition": "name", "account": "name", "time": "time",
    "nodelist": "hostlist", "output": "path", "agent_python": "path", "replica_dir": "path",
}  # fmt: skip
NUMBERS = {
    "gpus": st.integers(0, 8),
    "cpus": st.integers(1, 128),
    "mem_mb": st.one_of(st.none(), st.integers(1, 10**6)),
    "signal_lead_s": st.integers(0, 3600),
}


@st.composite
def serve_params(draw: st.DrawFn) -> Drawn:
    drawn = draw_fields(draw, SERVE_KINDS, {"gpu_type", "partition", "account", "nodelist"})
    drawn.fields.update({k: draw(v) for k, v in NUMBERS.items()}, pilot=draw(st.booleans()))
    return drawn


@given(drawn=serve_params())
@PROPS
def test_a_replica_s_script_holds_exactly_its_options_each_within_its_allow_list(
    drawn: Drawn,
) -> None:
    p = build(SbatchParams, drawn)
    if p is None:
        return
    assert isinstance(p, SbatchParams)
    script = render_sbatch(p)
    expected: list[tuple[str, str | None]] = [
        ("--job-name", p.job_name), ("--comment", p.comment), ("--nodes", "1"),
        ("--ntasks", "1"), ("--cpus-per-task", str(p.cpus)),
    ]  # fmt: skip
    if p.gpus > 0:
        expected.append(("--gres", p.gres))
    if p.partition:
        expected.append(("--partition", p.partition))
    if p.account:
        expected.append(("--account", p.account))
    expected.append(("--time", p.time))
    if p.nodelist:
        expected.append(("--nodelist", p.nodelist))
    if p.mem_mb:
        expected.append(("--mem", f"{p.mem_mb}M"))
    expected += [("--output", p.output), ("--open-mode", "append"),
                 ("--signal", f"B:USR1@{p.signal_lead_s}"), ("--requeue", None)]  # fmt: skip
    assert_directives(script, expected)
    agent = ["--pilot", p.replica_dir] if p.pilot else [p.replica_dir]
    assert shell_words(script, "exec ") == [
        ["exec", p.agent_python, "-I", "-m", "xhpc.agent", *agent]
    ]


BATCH_KINDS: dict[str, str | None] = {
    "batch_id": None, "job_name": "text", "comment": "text", "partition": "name", "qos": "name",
    "account": "name", "time": "time", "output": "path", "python": "path", "batch_dir": "path",
}  # fmt: skip


@st.composite
def batch_params(draw: st.DrawFn) -> Drawn:
    drawn = draw_fields(draw, BATCH_KINDS, {"partition", "qos", "account"})
    drawn.fields.update(
        last_task=draw(st.integers(0, 999)), gpus=draw(NUMBERS["gpus"]),
        cpus=draw(NUMBERS["cpus"]), signal_lead_s=draw(NUMBERS["signal_lead_s"]),
    )  # fmt: skip
    return drawn


@given(drawn=batch_params())
@PROPS
def test_a_batch_s_script_holds_exactly_its_options_each_within_its_allow_list(
    drawn: Drawn,
) -> None:
    p = build(BatchSbatchParams, drawn)
    if p is None:
        return
    assert isinstance(p, BatchSbatchParams)
    script = render_batch_sbatch(p)
    expected: list[tuple[str, str | None]] = [
        ("--job-name", p.job_name), ("--comment", p.comment), ("--array", f"0-{p.last_task}"),
        ("--nodes", "1"), ("--ntasks", "1"), ("--cpus-per-task", str(p.cpus)),
    ]  # fmt: skip
    if p.gpus > 0:
        expected.append(("--gres", f"gpu:{p.gpus}"))
    for option, value in (("--partition", p.partition), ("--qos", p.qos), ("--account", p.account)):
        if value:
            expected.append((option, value))
    expected += [("--time", p.time), ("--output", p.output), ("--open-mode", "append"),
                 ("--signal", f"B:USR1@{p.signal_lead_s}"), ("--requeue", None)]  # fmt: skip
    assert_directives(script, expected)
    assert shell_words(script, "exec ") == [
        ["exec", p.python, "-I", "-m", "xhpc.agent.batch_shard", p.batch_dir]
    ]


CACHE_KINDS: dict[str, str | None] = {
    "job_name": "text", "comment": "text", "partition": "name", "account": "name",
    "time": "time", "nodelist": "hostlist", "output": "path", "agent_python": "path",
    "args": WORDS,
}  # fmt: skip


@st.composite
def cache_params(draw: st.DrawFn) -> Drawn:
    return draw_fields(draw, CACHE_KINDS, {"partition", "account", "nodelist"})


@given(drawn=cache_params(), action=st.sampled_from(["evict", "pull"]))
@PROPS
def test_a_cache_job_s_script_holds_exactly_its_options_and_its_words(
    drawn: Drawn, action: str
) -> None:
    p = build(CacheSbatchParams, drawn, action=action)
    if p is None:
        return
    assert isinstance(p, CacheSbatchParams)
    script = render_cache_sbatch(p)
    expected: list[tuple[str, str | None]] = [
        ("--job-name", p.job_name), ("--comment", p.comment), ("--nodes", "1"),
        ("--ntasks", "1"), ("--cpus-per-task", "1"),
    ]  # fmt: skip
    for option, value in (("--partition", p.partition), ("--account", p.account)):
        if value:
            expected.append((option, value))
    expected.append(("--time", p.time))
    if p.nodelist:
        expected.append(("--nodelist", p.nodelist))
    expected.append(("--output", p.output))
    assert_directives(script, expected)
    assert shell_words(script, "exec ") == [
        ["exec", p.agent_python, "-I", "-m", "xhpc.agent.staging", action, *p.args]
    ]


PD_KINDS: dict[str, str | None] = {
    "unit_id": None, "deployment": None, "job_name": "text", "comment": "text",
    "partition": "name", "account": "name", "time": "time", "output": "path",
    "agent_python": "path",
}  # fmt: skip
COMPONENT_KINDS: dict[str, str | None] = {
    "replica_id": None, "role": None, "gpu_type": "name", "nodelist": "hostlist",
    "replica_dir": "path",
}  # fmt: skip


@st.composite
def pd_params(draw: st.DrawFn) -> tuple[Drawn, list[Drawn]]:
    unit = draw_fields(draw, PD_KINDS, {"partition", "account"})
    unit.fields.update(mem_mb=draw(NUMBERS["mem_mb"]), signal_lead_s=draw(NUMBERS["signal_lead_s"]))
    components = []
    for _ in range(draw(st.integers(2, 3))):
        component = draw_fields(draw, COMPONENT_KINDS, {"gpu_type", "nodelist"})
        component.fields.update(gpus=draw(st.integers(1, 8)), cpus=draw(NUMBERS["cpus"]))
        components.append(component)
    return unit, components


@given(drawn=pd_params())
@PROPS
def test_a_pd_unit_s_script_holds_exactly_each_component_s_options(
    drawn: tuple[Drawn, list[Drawn]],
) -> None:
    unit, components = drawn
    broken = unit.broken() | ({"components"} if any(c.broken() for c in components) else set())
    try:
        p = PdSbatchParams(**unit.fields, components=[c.fields for c in components])
    except PydanticValidationError as err:
        assert {str(e["loc"][0]) for e in err.errors()} == broken, err
        return
    assert broken == set(), f"accepted, though it breaks a rule: {drawn!r}"
    script = render_pd_sbatch(p)
    expected: list[tuple[str, str | None]] = [
        ("--job-name", p.job_name), ("--comment", p.comment), ("--output", p.output),
        ("--open-mode", "append"), ("--signal", f"B:USR1@{p.signal_lead_s}"),
        ("--no-requeue", None),
    ]  # fmt: skip
    for i, c in enumerate(p.components):
        if i:
            expected.append(("hetjob", None))
        expected += [("--nodes", "1"), ("--ntasks", "1"), ("--cpus-per-task", str(c.cpus)),
                     ("--gres", c.gres)]  # fmt: skip
        for option, value in (("--partition", p.partition), ("--account", p.account)):
            if value:
                expected.append((option, value))
        expected.append(("--time", p.time))
        if c.nodelist:
            expected.append(("--nodelist", c.nodelist))
        if p.mem_mb:
            expected.append(("--mem", f"{p.mem_mb}M"))
    assert_directives(script, expected)
    assert shell_words(script, "srun ") == [
        ["srun", f"--het-group={i}", p.agent_python, "-I", "-m", "xhpc.agent", c.replica_dir, "&"]
        for i, c in enumerate(p.components)
    ]


# -- the broker's doors ----------------------------------------------------------------------------
MEMBER = Caller(user="member", uid=4246)


@dataclass
class Broker:
    loop: BackgroundLoop
    service: BrokerService
    slurm: CapturingSlurm
    model_dir: Path
    sources: Path  # where the pulls' source directories are made
    made: int = 0  # names given out

    def fresh(self, prefix: str) -> str:
        self.made += 1
        return f"{prefix}{self.made}"

    def new_scripts(self, before: int) -> list[str]:
        scripts = self.slurm.scripts[before:]
        for script in scripts:
            assert directive_problems(script) == [], script
        return scripts


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    root = tmp_path_factory.mktemp("props-sbatch")
    model_dir = root / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    loop = BackgroundLoop()

    async def start() -> tuple[BrokerService, CapturingSlurm]:
        config = XhpcConfig(state_dir=root / "state", models_dir=root / "models")
        store = Store(root / "state" / "x.db")
        slurm = CapturingSlurm(parse_sinfo_json((DATA / "sinfo-idle.json").read_text()), store)
        return BrokerService(config, store, slurm), slurm

    service, slurm = loop.run(start())
    (root / "sources").mkdir()
    try:
        yield Broker(loop, service, slurm, model_dir, root / "sources")
    finally:
        loop.close()


def one_of_or_hostile(hostile: set[str], name: str, *valid: Any) -> st.SearchStrategy[Any]:
    return hostile_text() if name in hostile else st.sampled_from(valid)


SERVE_VALID: dict[str, tuple[Any, ...]] = {
    "partition": (None, "gpu"), "time": (None, "30:00", "01:00:00", "2-00"),
    "nodelist": (None, "n1", "n[1-2]"), "gpu_type": (None,), "pilot": (None, "n2"),
    "run_for": (None, "1-00"), "name": (None,), "node": (None, "n3"),
}  # fmt: skip


@st.composite
def serve_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A ServeRequest's fields that reach a job script: real values but for one or two
    hostile ones (``node``: a replica config's)."""
    hostile = draw(st.sets(st.sampled_from(sorted(SERVE_VALID)), max_size=2))
    fields = {k: draw(one_of_or_hostile(hostile, k, *v)) for k, v in SERVE_VALID.items()}
    node = fields.pop("node")
    fields.update(replicas=draw(st.integers(1, 2)), replica_configs=[] if node is None else
                  [{"node": node}])  # fmt: skip
    return fields


@given(fields=serve_requests())
@settings(PROPS, max_examples=60)
def test_a_member_s_serve_reaches_its_scripts_only_through_the_allow_lists(
    broker: Broker, fields: dict[str, Any]
) -> None:
    fields = {**fields, "model": str(broker.model_dir), "name": fields["name"] or broker.fresh("s")}
    try:
        req = ServeRequest(**fields)
    except PydanticValidationError:
        return
    before = len(broker.slurm.scripts)
    try:
        broker.loop.run(broker.service.serve(req, MEMBER))
    except XhpcError as err:
        event(f"refused: {type(err).__name__}")  # whatever it wrote before is read all the same
    finally:
        broker.loop.run(end_deployments(broker.service, MEMBER.user, frozenset()))
    nodes = {"n1", "n2", "n3"}
    event(f"scripts: {len(broker.slurm.scripts) - before}")
    for script in broker.new_scripts(before):
        lines = options(script)
        if req.partition is not None:
            assert lines["--partition"] == req.partition
        if req.time is not None:
            assert lines["--time"] == req.time
        if req.replica_configs:
            assert lines["--nodelist"] == req.replica_configs[0].node
        elif req.nodelist is not None and req.pilot is None:
            assert lines["--nodelist"] in {req.nodelist, *nodes}


@st.composite
def batch_requests(draw: st.DrawFn) -> dict[str, Any]:
    valid: dict[str, tuple[Any, ...]] = {
        "partition": (None, "gpu"), "qos": (None, "normal"), "time": ("30:00", "01:00:00"),
    }  # fmt: skip
    hostile = draw(st.sets(st.sampled_from(sorted(valid)), max_size=2))
    fields = {k: draw(one_of_or_hostile(hostile, k, *v)) for k, v in valid.items()}
    return {**fields, "gpus": draw(st.integers(0, 2)), "shards": draw(st.integers(1, 3))}


@given(fields=batch_requests())
@settings(PROPS, max_examples=60)
def test_a_member_s_batch_reaches_its_script_only_through_the_allow_lists(
    broker: Broker, fields: dict[str, Any]
) -> None:
    line = json.dumps({"custom_id": "q", "url": "/v1/chat/completions", "body": {}})
    try:
        req = BatchRequest(model=str(broker.model_dir), input_id="input_" + "0" * 24, **fields)
    except PydanticValidationError:
        return
    before = len(broker.slurm.scripts)

    async def create() -> None:
        input_id = broker.service.batches.inputs.save(MEMBER.user, line)
        await broker.service.batches.create(req.model_copy(update={"input_id": input_id}), MEMBER)

    try:
        broker.loop.run(create())
    except XhpcError as err:
        event(f"refused: {type(err).__name__}")
    event(f"scripts: {len(broker.slurm.scripts) - before}")
    for script in broker.new_scripts(before):
        lines = options(script)
        assert lines["--time"] == req.time
        if req.partition is not None:
            assert lines["--partition"] == req.partition
        assert lines.get("--qos") == req.qos


SOURCE_NAME = st.one_of(
    st.sampled_from(HOSTILE_WORDS),
    st.text(st.sampled_from(list("aZ0 '\"\\$`;&|<>*?~#-=@%:,.é€🙂")), min_size=1, max_size=30),
).filter(  # what a directory may be named
    lambda n: (
        n not in ("", ".", "..") and "/" not in n and "\x00" not in n and len(n.encode()) < 200
    )
)


@given(
    name=SOURCE_NAME,
    model=st.one_of(st.none(), st.none(), st.none(), hostile_text()),
    replace=st.booleans(),
)
@settings(PROPS, max_examples=40)
def test_a_pull_s_source_path_reaches_its_script_as_one_shell_word(
    broker: Broker, name: str, model: str | None, replace: bool
) -> None:
    """Any directory name a member could give (quotes, '$(...)', newlines, non-ASCII) stands
    on the job's command line as exactly one word; never on an #SBATCH line."""
    source = broker.sources / broker.fresh("src") / name
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    model = model or broker.fresh("pulled")
    try:
        pull = CachePull(model=model, source=str(source), replace=replace)
    except PydanticValidationError:
        assert not str(source).isprintable() or not NAME_RE.fullmatch(model)
        event("refused by CachePull")
        return
    before = len(broker.slurm.scripts)
    try:
        broker.loop.run(broker.service.cache.pulls.submit(pull))
    except XhpcError as err:  # a pull of that name in progress
        event(f"refused: {type(err).__name__}")
        assert broker.new_scripts(before) == []
        return
    (script,) = broker.new_scripts(before)
    (words,) = shell_words(script, "exec ")
    assert words[:6] == ["exec", broker.service.agent_python, "-I", "-m", "xhpc.agent.staging",
                         "pull"]  # fmt: skip
    assert words[6] == str(source) and words[8] == model
    assert words[10:] == (["--replace"] if replace else [])
    assert str(source) not in "\n".join(ln for ln in script.split("\n") if ln.startswith("#"))
