"""Prometheus text read from processes xhpc does not trust and written again
(``xhpc.prometheus``): what the format allows is kept, anything else is dropped line by line,
one family is written once, and labels of the writer's own come first, an engine's of the same
name renamed ``exported_<name>``. Every written exposition is read back by the strict reader
of the gateway's tests."""

from __future__ import annotations

import math

import pytest

from tests.test_proxy_gateway import Samples, value
from tests.test_proxy_gateway import parse_metrics as parse_strictly
from xhpc.prometheus import KINDS, MAX_LINE, Merge, parse, relabelled, sample_line

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/m, x"} 3.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="/m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="/m"} 2.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="/m"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="/m"} 1.5
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="/m"} 42.0
"""
WHERE = (("deployment", "m"), ("replica", "m-0"), ("job", "100"), ("node", "n1"))


def parse_metrics(text: str) -> Samples:
    """The gateway tests' strict reader, with every kind the format has."""
    return parse_strictly(text, KINDS)


def written(text: str, own: tuple[tuple[str, str], ...] = WHERE) -> str:
    merge = Merge()
    merge.add(parse(text).families.values(), own)
    return "\n".join(merge.lines()) + "\n"


def test_vllm_exposition_is_kept_whole_and_labelled_where_it_runs() -> None:
    read = parse(VLLM)
    assert read.dropped == 0
    assert [(f.name, f.kind, len(f.samples)) for f in read.families.values()] == [
        ("vllm:num_requests_running", "gauge", 1),
        ("vllm:e2e_request_latency_seconds", "histogram", 4),
        ("vllm:prompt_tokens_total", "counter", 1),
    ]
    text = written(VLLM)
    samples = parse_metrics(text)  # one TYPE per family, histograms whole
    where = dict(WHERE)
    assert value(samples, "vllm:num_requests_running", **where, engine="0", model_name="/m, x") == 3
    bucket = "vllm:e2e_request_latency_seconds_bucket"
    assert value(samples, bucket, **where, engine="0", le="+Inf", model_name="/m") == 2
    assert "# HELP vllm:num_requests_running Number of requests" in text


@pytest.mark.adversarial
def test_an_engine_cannot_inject_labels_or_lines() -> None:
    hostile = (
        'x{a="v\\",deployment=\\"other",b="c"} 1\n'  # a quote escaped: one label a, then b
        'y{deployment="evil",replica="m-9",exported_deployment="z"} 2\n'
        'z{a="one\\ntwo"} 3\n'  # an escaped line feed stays inside the value
        'w{a="bad \\x escape"} 4\n'  # no such escape: dropped
        'v{a="unterminated} 5\n'
        'u{__name__="x"} 6\n'  # reserved label names
        'q{a="1",a="2"} 7\n'  # a label twice
    )
    read = parse(hostile)
    assert read.dropped == 4
    text = written(hostile)
    samples = parse_metrics(text)
    where = dict(WHERE)
    # (the strict reader keeps values as written: escaped)
    assert value(samples, "x", **where, a='v\\",deployment=\\"other', b="c") == 1
    # The engine's own deployment/replica labels are kept, renamed as federation does (again
    # while the new name is taken).
    y = {**where, "exported_exported_deployment": "evil", "exported_replica": "m-9"}
    assert value(samples, "y", **y, exported_deployment="z") == 2
    assert 'z{deployment="m",replica="m-0",job="100",node="n1",a="one\\ntwo"} 3' in text
    assert sum(1 for line in text.splitlines() if not line.startswith("#")) == 3


@pytest.mark.adversarial
def test_huge_lines_odd_values_and_timestamps() -> None:
    long_value = "a" * (MAX_LINE + 10)
    text = "\n".join(
        [
            f'big{{l="{long_value}"}} 1',
            "nan_gauge NaN",
            "inf_gauge +Inf",
            "neg_gauge -Inf",
            "stamped 5 1700000000000",
            "underscore 1_000",  # Python's float() would take it; the format does not
            "hex 0x10",
            "words 1 2 3",
            'nospace{a="b"}1',
            "",
            "# a plain comment",
            "   indented 1",
            "unclosed{" + 'a="b",' * 2500 + " 1",  # just under the limit: read, and dropped
        ]
    )
    read = parse(text)
    kept = {s.name: s.value for s in read.samples()}
    assert set(kept) == {"nan_gauge", "inf_gauge", "neg_gauge", "stamped"}
    assert math.isnan(kept["nan_gauge"]) and kept["neg_gauge"] == -math.inf
    assert kept["stamped"] == 5  # the timestamp is dropped, not read as the value
    assert read.dropped == 7
    out = written(text, ())
    assert "nan_gauge NaN" in out and "inf_gauge +Inf" in out and "neg_gauge -Inf" in out
    assert "1700000000000" not in out


@pytest.mark.adversarial
def test_type_lies_and_duplicate_families_never_reach_the_exposition() -> None:
    lies = "\n".join(
        [
            "# TYPE h histogram",
            "h 3",  # a histogram's own name holds no sample
            'h_bucket{le="x"} 1',  # no numeric le
            "h_bucket 1",  # no le at all
            'h_bucket{le="+Inf"} 2',
            "h_sum 1",
            "h_count 2",
            "# TYPE h gauge",  # a second TYPE for a family: ignored
            "# TYPE h_sum counter",  # a name the histogram holds: ignored
            "late 1",
            "# TYPE late counter",  # after its samples: ignored, the family stays untyped
            "# TYPE s summary",
            's{quantile="0.5"} 1',
            "s 2",  # a summary's own name needs a quantile
            "s_count 1",
            "# TYPE bogus fancy",  # no such kind
            "# TYPE two words here",
            "dup 1",
            "dup 2",  # the same series again
            "g_bucket 1",  # an untyped family named like a histogram's samples...
            "# TYPE g histogram",  # ... so this TYPE cannot take it
        ]
    )
    read = parse(lies)
    kinds = {f.name: f.kind for f in read.families.values()}
    assert kinds == {
        "h": "histogram", "late": "untyped", "s": "summary", "dup": "untyped",
        "g_bucket": "untyped",
    }  # fmt: skip
    assert [s.name for s in read.families["h"].samples] == ["h_bucket", "h_sum", "h_count"]
    assert [s.value for s in read.families["dup"].samples] == [1]
    out = written(lies, ())
    types = [line for line in out.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len({t.split()[2] for t in types}) == 5


def test_families_of_several_engines_are_written_once_and_clashes_are_left_out() -> None:
    merge = Merge(reserved=lambda name: name.startswith("xhpc_"))
    one = parse(VLLM + "xhpc_broker_replicas 99\n")
    other = parse(
        "# TYPE vllm:num_requests_running counter\n"  # another kind than the first engine's
        "vllm:num_requests_running 1\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        "vllm:prompt_tokens_total 8\n"
        "vllm:e2e_request_latency_seconds_bucket 5\n"  # untyped here: the histogram's name
    )
    assert merge.add(one.families.values(), (("replica", "a"),)) == 1  # the reserved one
    assert merge.add(other.families.values(), (("replica", "b"),)) == 2
    text = "\n".join(merge.lines()) + "\n"
    samples = parse_metrics(text)
    tokens = "vllm:prompt_tokens_total"
    assert value(samples, tokens, replica="b") == 8
    assert value(samples, tokens, replica="a", engine="0", model_name="/m") == 42
    assert text.count("# TYPE vllm:prompt_tokens_total counter") == 1
    assert "xhpc_broker_replicas" not in text and 'replica="b"} 1' not in text


def test_relabelling_and_a_series_limit() -> None:
    assert relabelled((("a", "1"),), ()) == (("a", "1"),)
    assert relabelled((("node", "x"), ("le", "1")), (("node", "n1"),)) == (
        ("node", "n1"),
        ("exported_node", "x"),
        ("le", "1"),
    )
    assert sample_line("m", (("a", 'q"\\\n'),), 1.5) == 'm{a="q\\"\\\\\\n"} 1.5'
    many = "".join(f'c{{i="{i}"}} {i}\n' for i in range(50))
    assert len(list(parse(many, max_series=10).samples())) == 10
    limited = parse(VLLM).limited(3)
    assert len(list(limited.samples())) == 3 and limited.dropped == 3
