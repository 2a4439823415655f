"""The docs stay true to the tree: docs/architecture.md names every package and top-level module
of xhpc/, and no doc names a module that does not exist; every decision record has a status, and
a record that changes another is named in that other's status; nothing cites an issue number or
a file outside the project. Each check has a twin that feeds it a known-bad input, so it is
known to fail."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "xhpc"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DECISIONS = ROOT / "docs" / "decisions"

# `xhpc/broker/keeper.py`, `xhpc/placement/*`, `xhpc/proxy/`; not `~/.config/xhpc/config.toml`
_SLASHED = re.compile(r"(?<![\w./~-])xhpc/[\w./*-]*")
# `xhpc.agent`, `python -m xhpc.proxy`; not `<state_dir>/xhpc.db`
_DOTTED = re.compile(r"(?<![\w./~-])xhpc(?:\.[A-Za-z_]\w*)+")
# `xhpc.db` is a file, not a module
_FILE_NAMES = {"db", "toml", "json", "log", "sock", "lock", "md"}


def named_paths(text: str) -> set[str]:
    """Every path under xhpc/ the text names, as a path relative to the repository root
    (`xhpc.proxy.app` -> `xhpc/proxy/app`, `xhpc/broker/*` -> `xhpc/broker`)."""
    names: set[str] = set()
    for m in _SLASHED.finditer(text):
        name = m.group(0).rstrip(".,;:")
        name = re.sub(r"(/\*)+$", "", name).rstrip("/")
        names.add(name)
    for m in _DOTTED.finditer(text):
        if m.group(0).rsplit(".", 1)[1] not in _FILE_NAMES:
            names.add(m.group(0).replace(".", "/"))
    return names


def _module_file(name: str) -> Path | None:
    path = ROOT / name
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _exists(name: str) -> bool:
    if (ROOT / name).exists() or _module_file(name):
        return True
    # a dotted name's last part may be what the module defines:
    # xhpc.proxy.engines.liveness.JobLiveness
    module, _, attr = name.rpartition("/")
    source = _module_file(module)
    if source is None:
        return False
    text = source.read_text()
    defined = rf"^(?:class |def |async def )?{re.escape(attr)}\b"
    # ... or export it, as a package that loads its names lazily does (`xhpc.serve`)
    exported = rf"^__all__ = \[[^\]]*\"{re.escape(attr)}\""
    return bool(re.search(defined, text, re.MULTILINE) or re.search(exported, text, re.MULTILINE))


def missing_paths(text: str) -> list[str]:
    """Names in the text under xhpc/ that are no file, module or package of the tree."""
    return sorted(n for n in named_paths(text) if not _exists(n))


def package_parts(root: Path = PKG) -> list[str]:
    """Every package directory under xhpc/ and every module directly in xhpc/, as paths
    relative to the repository root (`xhpc/broker`, `xhpc/nvml.py`)."""
    parts = [
        d.relative_to(ROOT).as_posix()
        for d in sorted(root.rglob("*"))
        if d.is_dir() and (d / "__init__.py").is_file()
    ]
    parts += [
        f.relative_to(ROOT).as_posix() for f in sorted(root.glob("*.py")) if f.name != "__init__.py"
    ]
    return parts


def unnamed_parts(text: str, parts: list[str]) -> list[str]:
    """The packages and top-level modules the text never names (by path or dotted name)."""
    names = named_paths(text)
    return [p for p in parts if p not in names and p.removesuffix(".py") not in names]


def test_architecture_names_only_modules_that_exist() -> None:
    text = ARCHITECTURE.read_text()
    assert named_paths(text), "docs/architecture.md names no path under xhpc/"
    assert missing_paths(text) == [], "docs/architecture.md names what is not in the tree"


def test_every_doc_names_only_modules_that_exist() -> None:
    docs = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    missing = {d.relative_to(ROOT).as_posix(): missing_paths(d.read_text()) for d in docs}
    assert {d: m for d, m in missing.items() if m} == {}


def test_architecture_names_every_package_and_top_level_module() -> None:
    parts = package_parts()
    assert "xhpc/broker" in parts and "xhpc/nvml.py" in parts
    assert unnamed_parts(ARCHITECTURE.read_text(), parts) == [], (
        "docs/architecture.md should place these in its layers"
    )


def test_architecture_checks_can_fail() -> None:
    text = "entry xhpc/cli/*; xhpc/aio.py, xhpc/bogus_adapter.py and `xhpc.broker.no_such_module`"
    assert missing_paths(text) == ["xhpc/bogus_adapter.py", "xhpc/broker/no_such_module"]
    parts = ["xhpc/cli", "xhpc/aio.py", "xhpc/nvml.py", "xhpc/probe"]
    assert unnamed_parts(text, parts) == ["xhpc/nvml.py", "xhpc/probe"]
    assert unnamed_parts("xhpc.nvml and xhpc/probe/", parts[2:]) == []
    assert named_paths("`~/.config/xhpc/config.toml`, `<state_dir>/xhpc.db`, xhpc.db") == set()
    assert missing_paths("xhpc.errors.XhpcError, xhpc.broker.plan.plans.DeploymentPlan") == []
    assert missing_paths("xhpc.broker.plan.plans.NoSuchPlan") == [
        "xhpc/broker/plan/plans/NoSuchPlan"
    ]


# --- decision records ------------------------------------------------------------------------

_STATUS_LINES = 4  # the status is near the top: after the title and a blank line


def status_of(text: str) -> str | None:
    """The record's status paragraph (from `Status:` to the next blank line), if it is among
    its first lines."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:_STATUS_LINES]):
        if line.startswith("Status:"):
            para = [line]
            for more in lines[i + 1 :]:
                if not more.strip():
                    break
                para.append(more)
            return " ".join(para)
    return None


def records() -> dict[str, str]:
    return {p.name[:4]: p.read_text() for p in sorted(DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md"))}


def unanswered_changes(statuses: dict[str, str]) -> list[str]:
    """`A changes B` / `A supersedes B` in A's status, with A not named in B's status."""
    problems = []
    for a, status in statuses.items():
        for b in re.findall(r"(?:changes|supersedes|replaces) (\d{4})", status):
            if b not in statuses:
                problems.append(f"{a} changes {b}, which is no record")
            elif a not in statuses[b]:
                problems.append(f"{a} changes {b}, but {b}'s status does not name {a}")
    return problems


def test_every_decision_record_has_a_status() -> None:
    recs = records()
    assert len(recs) >= 14
    assert [n for n, text in recs.items() if status_of(text) is None] == []


def test_a_record_that_changes_another_is_named_in_its_status() -> None:
    statuses = {n: status_of(text) or "" for n, text in records().items()}
    assert unanswered_changes(statuses) == []


def test_decision_checks_can_fail() -> None:
    assert status_of("# 0099 - x\n\nContext.\n\nStatus: accepted\n") is None
    assert status_of("# 0099 - x\n\nStatus accepted\n") is None
    assert status_of("# 0099 - x\n\nStatus: accepted (changes\n0001)\n\nBody") == (
        "Status: accepted (changes 0001)"
    )
    statuses = {"0001": "Status: accepted", "0002": "Status: accepted (changes 0001)"}
    assert unanswered_changes(statuses) == [
        "0002 changes 0001, but 0001's status does not name 0002"
    ]


# --- no issue numbers, no files outside the project ------------------------------------------

SCANNED = ["xhpc", "docs", "scripts", "bench", "tests", ".ci", "site-configs"]
SCANNED_FILES = ["README.md", "pyproject.toml"]
TEXT_SUFFIXES = {"", ".py", ".md", ".toml", ".j2", ".sh", ".cfg", ".ini", ".yml", ".yaml", ".txt"}
# files of captured command output (tests/data/slurm/*.txt: `uname` prints `#1 SMP`)
NOT_SCANNED = {"tests/data"}

FORBIDDEN = {
    "an issue number": re.compile(r"\b[Ii]ssues? #?\d+\b"),
    "a #N reference": re.compile(r"(?:^|[\s(\[,])#\d+\b(?![:\w])"),
    "a path into a shared folder": re.compile(r"\.\./shared|(?<![\w.-])shared/"),
    "a file outside the project": re.compile(r"\b(?:MISSION|TESTBED|BENCHMARKS|STYLE)\.md\b"),
    "an unnamed source ('the seeds')": re.compile(r"\bthe seeds'"),
}


def scanned_files() -> list[Path]:
    out = [ROOT / f for f in SCANNED_FILES]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if (
                not path.is_file()
                or "__pycache__" in path.parts
                or any(rel.startswith(n + "/") for n in NOT_SCANNED)
                or path.suffix not in TEXT_SUFFIXES
                or path == Path(__file__).resolve()
            ):
                continue
            out.append(path)
    return out


def outside_references(rel: str, text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            m = pattern.search(line)
            if m:
                found.append(f"{rel}:{n}: {what}: {m.group(0).strip()!r}")
    return found


def test_no_issue_numbers_or_paths_outside_the_project() -> None:
    files = scanned_files()
    assert len(files) > 100
    found = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += outside_references(path.relative_to(ROOT).as_posix(), text)
    assert found == []


_MD = re.compile(r"(?<![\w/.-])([\w./-]*[\w-]\.md)\b")


def dangling_md(rel: str, text: str) -> list[str]:
    """`*.md` files the text names that are not in the project (tried from the root, from
    docs/, from docs/decisions/ and from the file's own folder)."""
    here = (ROOT / rel).parent
    bad = []
    for m in _MD.finditer(text):
        name = m.group(1)
        bases = (ROOT, ROOT / "docs", DECISIONS, here)
        if not any((base / name).is_file() for base in bases):
            bad.append(f"{rel}: {name}")
    return bad


def test_every_markdown_file_named_is_in_the_project() -> None:
    found = []
    for path in scanned_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += dangling_md(path.relative_to(ROOT).as_posix(), text)
    assert found == []


@pytest.mark.parametrize(
    ("line", "bad"),
    [
        ("as Issue 3 allows", True),
        ("see issue #12", True),
        ("fixed in (#123)", True),
        ("the facts in ../shared/TESTBED.md", True),
        ("copied from shared/notes", True),
        ("targets (BENCHMARKS.md)", True),
        ("see MISSION.md", True),
        ("the seeds' worker", True),
        ("color: #1f2937; see docs/lifecycle.md#requeue", False),
        ("http://host/v1/models#0 and a key's 3 issues", False),
        ("a shared_socket, /usr/share/doc, shared-memory/x", False),
        ("# 1. the first step", False),
    ],
)
def test_outside_reference_check_can_fail(line: str, bad: bool) -> None:
    assert bool(outside_references("x", line)) is bad


def test_markdown_check_can_fail() -> None:
    good = "see docs/lifecycle.md, pd.md and 0006-pilot-allocations.md"
    assert dangling_md("docs/x.md", good) == []
    assert dangling_md("docs/x.md", "see NOTES.md and docs/nothing.md") == [
        "docs/x.md: NOTES.md",
        "docs/x.md: docs/nothing.md",
    ]
