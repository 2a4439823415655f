"""The Batch API's files and a shard's checkpoint: malformed lines, torn records, shards, and
every input line answered exactly once however often a shard ran."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from xhpc.batch.lines import (
    MAX_LINE_BYTES,
    InputCheck,
    ProgressFile,
    ProgressReader,
    answered,
    answered_usage,
    assemble,
    duplicate_ids,
    parse_line,
    read_progress,
    refused,
    shard_range,
)

CHAT = "/v1/chat/completions"


def line(cid: str, **over: object) -> str:
    body = {"messages": [{"role": "user", "content": cid}]}
    data: dict[str, object] = {"custom_id": cid, "method": "POST", "url": CHAT, "body": body}
    data.update(over)
    return json.dumps(data)


def test_a_malformed_line_carries_its_own_problem_and_keeps_its_custom_id() -> None:
    assert parse_line(0, line("a"), CHAT).problem is None
    cases = {
        "{not json": ("not JSON", None),
        "[1, 2]": ("not a JSON object", None),
        line(""): ("custom_id", None),
        line("b", method="GET"): ("method must be POST", "b"),
        line("c", url="/v1/embeddings"): ("url must be", "c"),
        line("d", body="hi"): ("body must be", "d"),
        line("e", body={"stream": True}): ("streaming", "e"),
    }
    for raw, (why, cid) in cases.items():
        got = parse_line(4, raw, CHAT)
        assert got.problem is not None and why in got.problem and "line 5" in got.problem, got
        assert got.custom_id == cid
        out = refused(got)
        assert out["custom_id"] == cid and out["response"] is None
        assert why in out["error"]["message"]


def test_answers_go_to_the_output_file_and_refusals_to_the_error_file() -> None:
    parsed = parse_line(0, line("a"), CHAT)
    ok, out = answered(parsed, 200, {"choices": []})
    assert ok and out["error"] is None and out["response"]["status_code"] == 200
    assert out["id"].startswith("batch_req_") and out["custom_id"] == "a"
    ok, out = answered(parsed, 400, {"error": {"message": "too long"}})
    assert not ok and out["error"]["message"] == "too long"
    assert out["response"]["status_code"] == 400


def test_duplicate_ids_are_found() -> None:
    assert duplicate_ids([line("a"), line("b"), line("a"), "junk", line("a")], CHAT) == ["a"]
    assert duplicate_ids([line("a"), line("b")], CHAT) == []


@given(total=st.integers(0, 500), shards=st.integers(1, 40))
def test_shards_cover_every_line_once_in_near_equal_ranges(total: int, shards: int) -> None:
    ranges = [shard_range(total, shards, k) for k in range(shards)]
    covered = [i for r in ranges for i in r]
    assert covered == list(range(total))
    sizes = {len(r) for r in ranges}
    assert max(sizes) - min(sizes) <= 1


def test_a_record_torn_by_a_kill_is_dropped_and_its_line_answered_again(tmp_path: Path) -> None:
    path = tmp_path / "0.jsonl"
    progress = ProgressFile(path)
    for i in range(3):
        progress.add(i, True, {"custom_id": str(i)})
    progress.close()
    with path.open("ab") as f:
        f.write(b'{"line": 3, "ok": true, "out": {"custom_')  # killed mid-write
    again = ProgressFile(path)
    assert set(again.progress.done) == {0, 1, 2}
    again.add(3, False, {"custom_id": "3"})
    again.close()
    assert read_progress(path).done == {0: True, 1: True, 2: True, 3: False}
    assert all(json.loads(ln) for ln in path.read_text().splitlines())


@settings(max_examples=40, deadline=None)
@given(
    total=st.integers(1, 60),
    shards=st.integers(1, 5),
    kills=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 60), st.booleans()), max_size=6),
)
def test_every_line_is_answered_exactly_once_however_often_shards_are_killed(
    tmp_path_factory: object, total: int, shards: int, kills: list[tuple[int, int, bool]]
) -> None:
    """Each shard runs, is killed after some answers (maybe mid-record), and runs again until
    its range is done; the assembled files hold every custom_id once, in input order."""
    tmp = Path(str(tmp_path_factory.mktemp("b")))  # type: ignore[attr-defined]
    files = [tmp / f"{k}.jsonl" for k in range(shards)]
    plan = {k: [(n, torn) for s, n, torn in kills if s == k] for k in range(shards)}
    for k in range(shards):
        for stop_after, torn in [*plan[k], (10**6, False)]:
            progress = ProgressFile(files[k])
            sent = 0
            for i in shard_range(total, shards, k):
                if i in progress.progress.done:
                    continue
                if sent == stop_after:
                    break
                progress.add(i, i % 7 != 3, {"custom_id": f"id-{i}"})
                sent += 1
            progress.close()
            if torn:
                with files[k].open("ab") as f:
                    f.write(b'{"line": 0, "ok": tr')
    ok, failed = assemble(files, tmp / "out.jsonl", tmp / "err.jsonl")
    outs = [json.loads(x) for x in (tmp / "out.jsonl").read_text().splitlines()]
    errs = [json.loads(x) for x in (tmp / "err.jsonl").read_text().splitlines()]
    ids = [o["custom_id"] for o in outs] + [e["custom_id"] for e in errs]
    assert sorted(ids) == sorted(f"id-{i}" for i in range(total))
    assert len(ids) == len(set(ids)) == ok + failed == total
    assert [o["custom_id"] for o in outs] == [f"id-{i}" for i in range(total) if i % 7 != 3]


def record(line: int, ok: bool = True, pad: int = 0) -> bytes:
    out = {"custom_id": f"id-{line}", "pad": "x" * pad}
    return json.dumps({"line": line, "ok": ok, "out": out}).encode() + b"\n"


def whole(path: Path) -> dict[int, bool]:
    """The reference: the file read whole, up to its first torn or malformed record."""
    done: dict[int, bool] = {}
    for raw in path.read_bytes().splitlines(keepends=True) if path.exists() else []:
        if not raw.endswith(b"\n"):
            break
        try:
            data = json.loads(raw)
            done[int(data["line"])] = bool(data["ok"])
        except (ValueError, KeyError, TypeError):
            break
    return done


def test_a_progress_reader_reads_only_what_was_appended_since_its_last_read(
    tmp_path: Path,
) -> None:
    path = tmp_path / "0.jsonl"
    path.write_bytes(b"".join(record(i, i != 1, pad=500) for i in range(100)))
    reader = ProgressReader(path)
    first = reader.read()
    assert (first.completed, first.failed) == (99, 1) and reader.bytes_read == path.stat().st_size
    assert reader.read().done == first.done and reader.bytes_read == path.stat().st_size
    more = record(100, False) + record(101)
    with path.open("ab") as f:
        f.write(more)
    before = reader.bytes_read
    progress = reader.read()
    assert (progress.completed, progress.failed) == (100, 2)
    assert reader.bytes_read - before <= len(more) + ProgressReader.TAIL  # not the 50 kB again


def test_a_record_still_being_written_is_counted_once_it_is_whole(tmp_path: Path) -> None:
    path = tmp_path / "0.jsonl"
    rec = record(1)
    path.write_bytes(record(0) + rec[:20])  # the writer is mid-record
    reader = ProgressReader(path)
    assert reader.read().done == {0: True}
    with path.open("ab") as f:
        f.write(rec[20:])
    assert reader.read().done == {0: True, 1: True}


def test_a_file_cut_or_replaced_is_read_again_from_the_start(tmp_path: Path) -> None:
    path = tmp_path / "0.jsonl"
    path.write_bytes(b"".join(record(i) for i in range(5)))
    reader = ProgressReader(path)
    assert len(reader.read().done) == 5
    path.write_bytes(record(7, False))  # cut short, same inode
    assert reader.read().done == {7: False}
    other = tmp_path / "new.jsonl"
    other.write_bytes(record(8) + record(9, False))
    os.replace(other, path)  # another inode
    assert reader.read().done == {8: True, 9: False}
    with path.open("r+b") as f:  # cut, then written again past where it was read
        f.truncate(len(record(8)))
        f.seek(0, os.SEEK_END)
        f.write(record(3, False) + record(4, False) + record(5, False))
    assert reader.read().done == {8: True, 3: False, 4: False, 5: False}
    path.unlink()
    assert reader.read().done == {}


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 30), st.booleans()),
            st.tuples(st.just("torn"), st.integers(1, 40), st.booleans()),
            st.tuples(st.just("rerun"), st.integers(0, 0), st.booleans()),
            st.tuples(st.just("cut"), st.integers(0, 400), st.booleans()),
            st.tuples(st.just("replace"), st.integers(0, 30), st.booleans()),
        ),
        max_size=25,
    )
)
def test_a_progress_reader_always_agrees_with_reading_the_file_whole(
    tmp_path_factory: object, steps: list[tuple[str, int, bool]]
) -> None:
    """After any appends, torn records, reruns (which cut a torn record), cuts and
    replacements, read between any two of them, the reader holds what a whole read holds."""
    path = Path(str(tmp_path_factory.mktemp("p"))) / "0.jsonl"  # type: ignore[attr-defined]
    reader = ProgressReader(path)
    for kind, n, ok in steps:
        if kind == "add":
            with path.open("ab") as f:
                f.write(record(n, ok, pad=n * 7))
        elif kind == "torn":
            with path.open("ab") as f:
                f.write(record(n, ok)[:n])
        elif kind == "rerun":
            ProgressFile(path).close()
        elif kind == "cut" and path.exists():
            with path.open("r+b") as f:
                f.truncate(min(n, path.stat().st_size))
        elif kind == "replace":
            new = path.with_suffix(".new")
            new.write_bytes(record(n, ok))
            os.replace(new, path)
        assert reader.read().done == whole(path)


def test_a_batch_s_usage_counts_answered_lines_and_believes_only_counts(tmp_path: Path) -> None:
    def line(response: object) -> str:
        return json.dumps({"custom_id": "c", "response": response, "error": None})

    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    usage = {"prompt_tokens": 3, "completion_tokens": 4}
    out.write_text(
        "\n".join([
            line({"status_code": 200, "body": {"usage": usage}}),
            line({"status_code": 200, "body": {"usage": {"prompt_tokens": 2}}}),  # embeddings
            line({"status_code": 200, "body": {"usage": {"prompt_tokens": -5,
                  "completion_tokens": 10**20}}}),  # an engine's nonsense: 0
            line({"status_code": 200, "body": "not an object"}),
            "not json",
        ]) + "\n"
    )  # fmt: skip
    err.write_text(line({"status_code": 400, "body": {"error": {}}}) + "\n" + line(None) + "\n")
    assert answered_usage(out, err) == (5, 5, 4)  # the malformed (never sent) line is no request


def _checked(data: bytes, cuts: list[int]) -> str | None:
    check = InputCheck()
    start = 0
    for cut in sorted(cuts):
        check.feed(data[start:cut])
        start = max(start, cut)
    check.feed(data[start:])
    return check.problem()


_LINES = st.sampled_from([b'{"a": 1}', b"", b"  ", b"[1]", b"{bad", b"\xff\xfe", b'{"b": "x"}',
                          b'"s"', b"{}\r"])  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(_LINES, max_size=8), st.booleans(), st.lists(st.integers(0, 120), max_size=6))
def test_an_input_is_judged_the_same_however_its_bytes_arrive(
    lines: list[bytes], final_newline: bool, cuts: list[int]
) -> None:
    """The upload's chunks may cut a line (or a UTF-8 character) anywhere: the verdict, and the
    line it names, are those of the whole file read at once."""
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    assert _checked(data, cuts) == _checked(data, [])


def test_the_first_bad_line_is_named_and_known_before_the_rest_arrives() -> None:
    check = InputCheck()
    check.feed(b'{"ok": 1}\n\n[2]\n{"late"')
    assert check.bad == "line 3 is not a JSON object"
    check.feed(b": 1}\n")  # the rest changes nothing
    assert check.problem() == "line 3 is not a JSON object"
    assert InputCheck().problem() == "the file holds no requests"
    blank = InputCheck()
    blank.feed(b"\n  \n")
    assert blank.problem() == "the file holds no requests"


def test_a_line_too_long_is_refused_while_it_is_still_arriving() -> None:
    """An endless line (no newline) is not held in memory to its end: past the limit it is
    refused at once."""
    check = InputCheck()
    check.feed(b'{"ok": 1}\n')
    for _ in range(MAX_LINE_BYTES // (1 << 16) + 2):
        check.feed(b"x" * (1 << 16))
        if check.bad:
            break
    assert check.bad == f"line 2 is over {MAX_LINE_BYTES} bytes"
