"""Remote use's command line, without SSH: which options stay here, what is sent, where to
connect, and a remote line that a POSIX shell reads back as the same words."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from tests.unit.conftest import Run
from xhpc.cli.main import _remote_split
from xhpc.errors import ValidationError
from xhpc.remote.argv import Destination, parse_destination, remote_command, split_remote

GROUP = {"--site"}


def test_no_remote_is_no_split() -> None:
    assert split_remote(["--site", "s.toml", "ps", "--remote", "x"], GROUP) is None


def test_the_connection_options_stay_and_the_rest_goes_in_order() -> None:
    split = split_remote(
        ["--debug", "--remote=al@login:2222", "--site", "--remote", "--identity", "k1",
         "--identity=k2", "--accept-new-host-key", "--known-hosts", "kh", "ps", "--remote", "x"],
        GROUP,
    )  # fmt: skip
    assert split is not None
    assert split.forwarded == ["--debug", "--site", "--remote", "ps", "--remote", "x"]
    assert split.command == "ps"
    o = split.options
    assert (o.destination, o.identities, o.known_hosts) == ("al@login:2222", ("k1", "k2"), "kh")
    assert o.accept_new_host_key and o.remote_xhpc is None


def test_a_command_that_runs_here_is_left_to_the_local_cli() -> None:
    assert _remote_split(["--remote", "h", "tunnel", "--port", "0"]) is None
    split = _remote_split(["--remote", "h", "--site", "tunnel", "ps"])
    assert split is not None and split.command == "ps"  # `tunnel` was --site's value


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--remote"], "option --remote needs a value"),
        (["--remote", "a", "--remote", "b", "ps"], "option --remote given 2 times"),
    ],
)
def test_bad_connection_options_are_one_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        split_remote(argv, GROUP)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("al@login", Destination("al", "login", 22)),
        ("al@login.lab.org:2222", Destination("al", "login.lab.org", 2222)),
        ("login", Destination("me", "login", 22)),
        ("al@[::1]:2200", Destination("al", "::1", 2200)),
        ("al@::1", Destination("al", "::1", 22)),
    ],
)
def test_destinations(text: str, want: Destination) -> None:
    assert parse_destination(text, default_user="me") == want


@pytest.mark.parametrize(
    "text", ["al@", "@login", "a l@login", "al@login:x", "al@login:0", "al@-oProxyCommand=x",
             "al@[::1", "al@lo;gin", "al@login:70000"],
)  # fmt: skip
def test_bad_destinations_are_refused(text: str) -> None:
    with pytest.raises(ValidationError, match="--remote"):
        parse_destination(text, default_user="me")


def test_a_destination_prints_as_given() -> None:
    assert str(Destination("al", "::1", 2200)) == "al@[::1]:2200"
    assert str(Destination("al", "login", 22)) == "al@login"


HOSTILE = ["a b", "it's", '"q"', "x; rm -rf /", "$(id)", "`id`", "*", "a\nb", "", "~", "-", "\\"]


def test_the_remote_line_is_read_back_by_a_shell_as_the_same_words() -> None:
    line = remote_command("/opt/x hpc/bin/python -m xhpc", HOSTILE)
    assert shlex.split(line) == ["/opt/x", "hpc/bin/python", "-m", "xhpc", *HOSTILE]
    printed = subprocess.run(
        ["/bin/sh", "-c", remote_command("printf %s\\\\0", HOSTILE)],
        capture_output=True,
        check=True,
    ).stdout
    assert printed.decode().split("\0")[:-1] == HOSTILE


def test_a_remote_xhpc_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValidationError, match="remote xhpc"):
        remote_command("'unclosed", ["ps"])
    with pytest.raises(ValidationError, match="empty"):
        remote_command("  ", ["ps"])


def test_bad_remote_input_exits_before_any_connection(xhpc: Run) -> None:
    done = xhpc("--remote", "a b@127.0.0.1:1", "ps")
    assert (done.code, done.out) == (2, "")
    assert done.err.startswith("error: --remote 'a b@127.0.0.1:1'") and done.err.count("\n") == 1


def test_tunnel_without_remote_is_an_error(xhpc: Run) -> None:
    done = xhpc("tunnel")
    assert (done.code, done.err) == (
        2,
        "error: xhpc tunnel needs --remote USER@HOST (the login node)\n",
    )


def test_connection_options_without_remote_are_an_error(xhpc: Run) -> None:
    done = xhpc("--identity", "k", "ps")
    assert done.code == 2 and "only with --remote" in done.err
