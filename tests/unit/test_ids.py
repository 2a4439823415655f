"""One rule per kind of id, and control paths built only from constant words and checked ids:
hostile ids never become a path, a query or a file name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xhpc.client.control import Client
from xhpc.client.http import BrokerTransport
from xhpc.errors import NotFoundError
from xhpc.ids import Id, IdKind, control_path, new_batch_id, new_file_id, new_input_id, valid

HOSTILE = [
    "", "..", "../keys/0123456789ab/revoke?", "batch_0123456789abcdef01234567?owner=ann",
    "batch_0123456789abcdef01234567/../x", "a b", "a\nb", "%2e%2e", "x#y", "é", "a/b", 12,
]  # fmt: skip


def test_each_kind_has_one_rule_and_new_ids_pass_it() -> None:
    assert valid(IdKind.BATCH, new_batch_id()) and valid(IdKind.FILE, new_file_id())
    assert valid(IdKind.BATCH_INPUT, new_input_id())
    assert valid(IdKind.RESULT_FILE, f"file-out-{new_batch_id()}")
    assert valid(IdKind.KEY, "0123456789ab") and not valid(IdKind.KEY, "0123456789abc")
    assert valid(IdKind.NAME, "tiny-llama.v2") and not valid(IdKind.NAME, ".hidden")
    for near in ("batch_0123456789ABCDEF01234567", "batch_0123456789abcdef0123456"):
        assert not valid(IdKind.BATCH, near)
    for kind in IdKind:
        for value in HOSTILE:
            assert not valid(kind, value), (kind, value)
            with pytest.raises(ValueError):
                Id(kind, value)  # type: ignore[arg-type]


def test_a_control_path_is_built_from_words_and_checked_ids_only() -> None:
    batch = new_batch_id()
    assert control_path("v1", "batches", Id(IdKind.BATCH, batch), "cancel") == (
        f"/v1/batches/{batch}/cancel"
    )
    assert control_path("v1", "batches", query={"errors": 1, "x": "a&b=c"}) == (
        "/v1/batches?errors=1&x=a%26b%3Dc"
    )
    for segment in ("..", "a/b", "keys?x=1", "", "V1", "%2F"):
        with pytest.raises(ValueError, match="not a control path segment"):
            control_path("v1", segment)


class Recording(BrokerTransport):
    def __init__(self) -> None:
        super().__init__(Path("/nonexistent.sock"))
        self.calls: list[str] = []

    def request(self, method: str, path: str, body: str | None = None, headers: Any = None) -> Any:
        self.calls.append(path)
        return {}


@pytest.mark.security
def test_the_client_refuses_a_malformed_id_before_any_call() -> None:
    """Hostile ids typed at the CLI are "no such thing", never a path to the broker."""
    transport = Recording()
    client = Client.over(transport)
    for value in HOSTILE[:11]:
        for call in (client.batch, client.cancel_batch, client.batch_output, client.revoke_key,
                     client.cache_pull_status, client.deployment, client.logs):  # fmt: skip
            with pytest.raises(NotFoundError):
                call(value)  # type: ignore[arg-type]
    assert transport.calls == []
