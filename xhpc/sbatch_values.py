"""What may reach an ``#SBATCH`` line (foundation): one allow-list per kind of value.

Shell quoting does not protect an ``#SBATCH`` line. Slurm's own parser reads those lines, and it
honours a backslash inside quotes, so a value such as ``x\\' --export=ALL #`` adds options to the
job whatever ``shlex.quote`` made of it. Every value that lands on such a line is therefore held
to a strict character allow-list here, at every door (the CLI, the control API, the gateway, the
Python API, catalogs, the site config), and again when the script is rendered
(``xhpc.render``): the renderer refuses anything this module would refuse.

The kinds:

- ``SlurmName``: a partition, QoS, account, GPU type or node: ``[A-Za-z0-9][A-Za-z0-9._-]*``, at
  most 63 characters.
- ``HostList``: a node list (``n[1-3],n7``): a name's characters plus ``,[]``, at most 201.
- ``SlurmTime``: Slurm's ``[D-]HH:MM:SS`` forms (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
  ``D-H:M:S``), or ``UNLIMITED`` / ``INFINITE``.
- ``JobPath``: an absolute path xhpc made (the job's output file): ``/`` then
  ``[A-Za-z0-9._/%@+=:,-]``, no ``..`` component, at most 1024 characters.
- ``JobText``: a job name or comment xhpc made: ``[A-Za-z0-9._:@+=-]``, at most 200,
  starting with a letter or digit.

A value never starts with ``-`` (it would read as an option), and never holds a blank, a quote,
a backslash, ``#``, ``$``, a control character or anything outside ASCII.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

_RULES: dict[str, tuple[re.Pattern[str], str]] = {
    "name": (
        re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"),
        "use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
    ),
    "hostlist": (
        re.compile(r"[A-Za-z0-9][A-Za-z0-9._,\[\]-]{0,200}"),
        "use up to 201 letters, digits, '.', '_', '-', ',', '[' or ']' (a Slurm name or host "
        "list), starting with a letter or digit",
    ),
    "time": (
        # [0-9], not \d: a regex's \d also takes every other script's digits (U+0660-U+0669...)
        re.compile(
            r"([0-9]{1,4}-[0-9]{1,2}(:[0-9]{1,2}){0,2}|[0-9]{1,6}(:[0-9]{1,2}){0,2}"
            r"|UNLIMITED|INFINITE)"
        ),
        "use Slurm's [D-]HH:MM:SS form",
    ),
    "path": (
        re.compile(r"/[A-Za-z0-9._/%@+=:,-]{0,1023}"),
        "an absolute path of letters, digits and '._/%@+=:,-'",
    ),
    "text": (
        re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}"),
        "use 1-200 letters, digits or '._:@+=-', starting with a letter or digit",
    ),
}
KINDS = frozenset(_RULES)


def shown(value: str) -> str:
    """``value`` as an error may print it: one short printable line."""
    return (
        value if value.isprintable() and value.isascii() and len(value) <= 80 else repr(value[:80])
    )


def sbatch_problem(kind: str, value: str, what: str) -> str | None:
    """Why ``value`` may not stand on an ``#SBATCH`` line as a ``kind``; None when it may."""
    pattern, rule = _RULES[kind]
    if not pattern.fullmatch(value):
        return f"invalid {what} {shown(value)}: {rule}"
    if kind == "path" and ".." in value.split("/"):
        return f"invalid {what} {shown(value)}: no '..' component"
    return None


def check_sbatch(kind: str, value: str, what: str) -> str:
    """``value`` when it may stand on an ``#SBATCH`` line as a ``kind``; ValueError otherwise."""
    problem = sbatch_problem(kind, value, what)
    if problem is not None:
        raise ValueError(problem)
    return value


def _rule(kind: str, what: str) -> AfterValidator:
    return AfterValidator(lambda v: check_sbatch(kind, v, what))


SlurmName = Annotated[str, _rule("name", "Slurm name")]
GpuType = Annotated[str, _rule("name", "GPU type")]
PartitionName = Annotated[str, _rule("name", "partition")]
QosName = Annotated[str, _rule("name", "QoS")]
AccountName = Annotated[str, _rule("name", "account")]
HostList = Annotated[str, _rule("hostlist", "node list")]
SlurmTime = Annotated[str, _rule("time", "time limit")]
JobPath = Annotated[str, _rule("path", "path")]
JobText = Annotated[str, _rule("text", "job name or comment")]
