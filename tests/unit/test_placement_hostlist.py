"""Slurm hostlist expressions -> node names."""

from __future__ import annotations

import pytest

from xhpc.errors import SlurmParseError
from xhpc.placement import expand_hostlist


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("n1", ("n1",)),
        ("n[1-3,5],gpu01", ("n1", "n2", "n3", "n5", "gpu01")),
        ("gpu[08-11]", ("gpu08", "gpu09", "gpu10", "gpu11")),
        ("n[001-003]", ("n001", "n002", "n003")),
        ("n[9-10]", ("n9", "n10")),
        ("n[1-2]-ib", ("n1-ib", "n2-ib")),
        ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
        ("a,b[1,3],c", ("a", "b1", "b3", "c")),
        (" n[1-2] , n3 ", ("n1", "n2", "n3")),
        ("n1,n1,n[1-2]", ("n1", "n2")),
        ("node-a.b_c", ("node-a.b_c",)),
    ],
)
def test_expand_hostlist(text: str, names: tuple[str, ...]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", [None, "", "   ", "(null)", "None assigned"])
def test_no_hosts(text: str | None) -> None:
    assert expand_hostlist(text) == ()


@pytest.mark.parametrize(
    "text", ["n[1-", "n1]", "n[[1]]", "n[a-b]", "n[3-1]", "n[]", "n[1-2-3]", "n[1-99999999]"]
)
def test_malformed_hostlist_is_a_parse_error(text: str) -> None:
    with pytest.raises(SlurmParseError):
        expand_hostlist(text)
