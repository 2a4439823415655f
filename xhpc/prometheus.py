"""Prometheus text (exposition format 0.0.4), both ways: the series xhpc keeps and writes, and
the series it reads from processes it does not trust, which are checked line by line and
written again, never passed through.

Writing (the proxy's and the broker's own metrics): ``Counter`` and ``Histogram`` are kept by
their owner, a dict lookup and an add per count; ``gauge`` renders values read when scraped.
Label values are escaped (backslash, double quote, line feed).

Reading (``parse``: an engine's ``/metrics``, a broker's ``/v1/metrics``):

- A line over ``MAX_LINE`` characters, or one that is no comment, ``# HELP``, ``# TYPE`` or
  sample by the format's grammar, is dropped: names in the format's character sets, label
  values with the format's three escapes only (any other drops the line), a label named twice
  or starting with ``__``, a value that is no decimal number, ``NaN`` or ``±Inf``. A sample's
  timestamp is dropped.
- A family is declared by its first ``# TYPE`` only. A second one for the same name, one whose
  sample names another family holds already (``foo_bucket`` read as an untyped sample before
  ``# TYPE foo histogram``), and one that comes after the family's samples are ignored: the
  family stays as first seen. A histogram's samples are ``<name>_bucket`` (with a numeric
  ``le``), ``<name>_sum`` and ``<name>_count``; a summary's ``<name>`` (with a numeric
  ``quantile``), ``_sum`` and ``_count``; any other family's its own name. A sample that does
  not fit its family is dropped; a sample no ``# TYPE`` declared is an untyped family of its own.
- A sample repeated (same name and labels) is dropped, and at most ``max_series`` are kept.

``Merge`` writes families from several sources as one exposition: each family once (one
``# TYPE``, its samples together), each source's samples with labels of the source's own
(``deployment``, ``replica``; a broker's ``member``); a label the source already had under
such a name is renamed ``exported_<name>``, as Prometheus' federation does. A family whose kind
or sample names clash with a family already there is left out, as are the names the writer
keeps for itself (``reserved``).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

Labels = tuple[str, ...]
"""A series' label values, in the order of its metric's label names (what xhpc keeps)."""
LabelPairs = tuple[tuple[str, str], ...]
"""A sample's labels as read: (name, value), in the order they came."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KINDS = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})
MAX_LINE = 16 * 1024  # characters; a longer line is dropped unread
MAX_HELP = 1024  # characters of a family's help kept
EXPORTED = "exported_"

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*+)"')
# The labels between the braces, as the format writes them; possessive (*+): a line that is not
# the format's fails in one pass, whatever its length.
_SHAPE = r'[ \t]*+[a-zA-Z_][a-zA-Z0-9_]*+[ \t]*+=[ \t]*+"(?:[^"\\]|\\.)*+"[ \t]*+'
_SAMPLE = re.compile(  # name, labels, value, timestamp
    rf"({_NAME.pattern})(?:\{{((?:{_SHAPE},)*+(?:{_SHAPE})?+)\}})?+[ \t]++(\S++)"
    r"(?:[ \t]++(\S++))?+[ \t]*+"
)
_ESCAPED = re.compile(r"(?:[^\\]|\\[\\\"n])*")
_UNESCAPE = re.compile(r"\\(.)")
_VALUE = re.compile(
    r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?)"
    r"|[nN][aA][nN]"
)
_TIMESTAMP = re.compile(r"-?\d{1,19}")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}


# --- writing ---


def escape(value: str) -> str:
    """A label value as the format writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def number(value: float) -> str:
    """A sample's value as the format writes it."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


def labels_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def sample_line(name: str, labels: LabelPairs, value: float) -> str:
    shown = ",".join(f'{k}="{escape(v)}"' for k, v in labels)
    return f"{name}{{{shown}}} {number(value)}" if labels else f"{name} {number(value)}"


def header(name: str, help_: str, kind: str) -> list[str]:
    shown = help_.replace("\\", "\\\\").replace("\n", "\\n")
    return [f"# HELP {name} {shown}", f"# TYPE {name} {kind}"]


class Counter:
    __slots__ = ("help", "labelnames", "name", "values")

    def __init__(self, name: str, help_: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.help = help_
        self.labelnames = tuple(labelnames)
        self.values: dict[Labels, float] = {}

    def inc(self, labels: Labels, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def value(self, labels: Labels) -> float:
        return self.values.get(labels, 0.0)

    def render(self, values: dict[Labels, float] | None = None) -> list[str]:
        lines = header(self.name, self.help, "counter")
        for labels, value in sorted((self.values if values is None else values).items()):
            lines.append(f"{self.name}{labels_text(self.labelnames, labels)} {number(value)}")
        return lines


class Histogram:
    __slots__ = ("buckets", "help", "labelnames", "name", "values")

    def __init__(
        self, name: str, help_: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.help = help_
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(buckets)
        self.values: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe(self, labels: Labels, value: float) -> None:
        entry = self.values.get(labels)
        if entry is None:
            entry = self.values[labels] = ([0] * (len(self.buckets) + 1), [0.0])
        entry[0][bisect.bisect_left(self.buckets, value)] += 1
        entry[1][0] += value

    def count(self, labels: Labels) -> int:
        entry = self.values.get(labels)
        return sum(entry[0]) if entry is not None else 0

    def render(
        self, values: dict[Labels, tuple[list[int], list[float]]] | None = None
    ) -> list[str]:
        lines = header(self.name, self.help, "histogram")
        for labels, (counts, total) in sorted((self.values if values is None else values).items()):
            running = 0
            for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
                running += n
                le = labels_text(self.labelnames, labels, f'le="{number(bound)}"')
                lines.append(f"{self.name}_bucket{le} {running}")
            shown = labels_text(self.labelnames, labels)
            lines.append(f"{self.name}_sum{shown} {number(total[0])}")
            lines.append(f"{self.name}_count{shown} {running}")
        return lines


def gauge(
    name: str, help_: str, labelnames: Sequence[str], values: Iterable[tuple[Labels, float]]
) -> list[str]:
    lines = header(name, help_, "gauge")
    for labels, value in sorted(values):
        lines.append(f"{name}{labels_text(labelnames, labels)} {number(value)}")
    return lines


# --- reading ---


class Sample(NamedTuple):
    name: str
    labels: LabelPairs
    value: float

    def label(self, name: str) -> str | None:
        return next((v for k, v in self.labels if k == name), None)


@dataclass
class Family:
    name: str
    kind: str  # one of KINDS
    help: str = ""
    samples: list[Sample] = field(default_factory=list)


@dataclass
class Exposition:
    """What was kept of one text: its families in the order they came, and how many lines
    were not kept."""

    families: dict[str, Family] = field(default_factory=dict)
    dropped: int = 0

    def samples(self) -> Iterable[Sample]:
        for family in self.families.values():
            yield from family.samples

    def limited(self, max_series: int) -> Exposition:
        """The first ``max_series`` samples only (the others counted as dropped)."""
        out = Exposition(dropped=self.dropped)
        left = max_series
        for family in self.families.values():
            kept = family.samples[: max(0, left)]
            out.dropped += len(family.samples) - len(kept)
            left -= len(kept)
            if kept:
                out.families[family.name] = Family(family.name, family.kind, family.help, kept)
        return out


def sample_names(name: str, kind: str) -> tuple[str, ...]:
    """The sample names a family of this kind holds."""
    if kind == "histogram":
        return (f"{name}_bucket", f"{name}_sum", f"{name}_count")
    if kind == "summary":
        return (name, f"{name}_sum", f"{name}_count")
    return (name,)


def _unescape(raw: str) -> str | None:
    if "\\" not in raw:
        return raw
    if not _ESCAPED.fullmatch(raw):
        return None
    return _UNESCAPE.sub(lambda m: _UNESCAPED[m.group(1)], raw)


def _sample(line: str) -> Sample | None:
    m = _SAMPLE.fullmatch(line)
    if m is None:
        return None
    name, block, raw, stamp = m.groups()
    if not _VALUE.fullmatch(raw) or (stamp is not None and not _TIMESTAMP.fullmatch(stamp)):
        return None
    labels: LabelPairs = ()
    if block:  # its shape is the format's (``_SAMPLE``): its pairs come in order
        pairs = []
        for key, escaped in _PAIR.findall(block):
            value = _unescape(escaped)
            if value is None or key.startswith("__"):
                return None
            pairs.append((key, value))
        labels = tuple(pairs)
        if len({k for k, _ in labels}) != len(labels):
            return None
    return Sample(name, labels, float(raw))


def _is_number(text: str | None) -> bool:
    return text is not None and _VALUE.fullmatch(text) is not None


class _Reader:
    def __init__(self, max_series: int) -> None:
        self.max_series = max_series
        self.out = Exposition()
        self.owner: dict[str, str] = {}  # sample name -> the family holding it
        self.helps: dict[str, str] = {}
        self.seen: set[tuple[str, LabelPairs]] = set()
        self.kept = 0

    def line(self, line: str) -> None:
        line = line.rstrip("\r")
        if not line.strip():
            return
        if len(line) > MAX_LINE:
            self.out.dropped += 1
        elif line.startswith("#"):
            self.comment(line)
        elif not self.sample(line):
            self.out.dropped += 1

    def comment(self, line: str) -> None:
        parts = line[1:].lstrip(" \t").split(None, 2)
        if len(parts) < 2 or parts[0] not in ("TYPE", "HELP"):
            return  # a plain comment
        if parts[0] == "HELP":
            text = _unescape(parts[2]) if len(parts) == 3 else ""
            name = parts[1]
            fits = len(self.helps) < self.max_series and name not in self.helps
            if fits and text is not None and _NAME.fullmatch(name):
                self.helps[name] = text[:MAX_HELP]
            return
        name, kind = parts[1], parts[2].strip() if len(parts) == 3 else ""
        families = self.out.families
        names = sample_names(name, kind)
        if (
            not _NAME.fullmatch(name)
            or kind not in KINDS
            or name in families
            or name in self.owner
            or any(n in self.owner for n in names)
            or len(families) >= self.max_series
        ):
            self.out.dropped += 1
            return
        families[name] = Family(name, kind)
        for n in names:
            self.owner[n] = name

    def sample(self, line: str) -> bool:
        sample = _sample(line)
        if sample is None or self.kept >= self.max_series:
            return False
        key = (sample.name, sample.labels)
        if key in self.seen:
            return False
        family = self._family(sample)
        if family is None:
            return False
        self.seen.add(key)
        family.samples.append(sample)
        self.kept += 1
        return True

    def _family(self, sample: Sample) -> Family | None:
        families = self.out.families
        held = self.owner.get(sample.name)
        if held is None:
            if sample.name in families or len(families) >= self.max_series:
                return None  # a histogram's own name, which none of its samples has
            family = families[sample.name] = Family(sample.name, "untyped")
            self.owner[sample.name] = sample.name
            return family
        family = families[held]
        if family.kind == "histogram" and sample.name == f"{held}_bucket":
            return family if _is_number(sample.label("le")) else None
        if family.kind == "summary" and sample.name == held:
            return family if _is_number(sample.label("quantile")) else None
        return family

    def done(self) -> Exposition:
        for name, family in self.out.families.items():
            family.help = self.helps.get(name, "")
        return self.out


def parse(text: str, max_series: int = 1_000_000) -> Exposition:
    """What may be kept of ``text`` by the rules above (the module docstring)."""
    reader = _Reader(max_series)
    for line in text.split("\n"):
        reader.line(line)
    return reader.done()


# --- writing what was read ---


def relabelled(labels: LabelPairs, own: LabelPairs) -> LabelPairs:
    """``own`` and then ``labels``, those of ``labels`` named as one of ``own`` renamed
    ``exported_<name>`` (again while that name is taken)."""
    if not own:
        return labels
    mine = {k for k, _ in own}
    taken = mine | {k for k, _ in labels}
    out = list(own)
    for key, value in labels:
        if key in mine:
            renamed = EXPORTED + key
            while renamed in taken:
                renamed = EXPORTED + renamed
            taken.add(renamed)
            key = renamed
        out.append((key, value))
    return tuple(out)


@dataclass
class _Merged:
    kind: str
    help: str
    lines: list[str] = field(default_factory=list)


class Merge:
    """Families of several sources as one exposition (the module docstring); ``reserved``:
    the family names the writer keeps for itself (left out of every source)."""

    def __init__(self, reserved: Callable[[str], bool] = lambda _: False) -> None:
        self.reserved = reserved
        self.families: dict[str, _Merged] = {}
        self.owner: dict[str, str] = {}  # sample name -> family name
        self.dropped = 0  # samples left out

    def add(self, families: Iterable[Family], own: LabelPairs = ()) -> int:
        """Add one source's families, each sample labelled with ``own`` first; how many of
        its samples were left out."""
        before = self.dropped
        for family in families:
            if not family.samples:
                continue
            merged = self._family(family)
            if merged is None:
                self.dropped += len(family.samples)
                continue
            merged.lines += (
                sample_line(s.name, relabelled(s.labels, own), s.value) for s in family.samples
            )
        return self.dropped - before

    def _family(self, family: Family) -> _Merged | None:
        name, kind = family.name, family.kind
        if self.reserved(name):
            return None
        merged = self.families.get(name)
        if merged is not None:
            return merged if merged.kind == kind else None
        names = sample_names(name, kind)
        if name in self.owner or any(n in self.owner for n in names):
            return None
        merged = self.families[name] = _Merged(kind, family.help)
        self.owner[name] = name  # a histogram's own name: no other family may take it
        for n in names:
            self.owner[n] = name
        return merged

    def lines(self) -> list[str]:
        out: list[str] = []
        for name, merged in self.families.items():
            if merged.help:
                out += header(name, merged.help, merged.kind)
            else:
                out.append(f"# TYPE {name} {merged.kind}")
            out += merged.lines
        return out
