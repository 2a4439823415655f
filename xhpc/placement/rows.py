"""The placement arrays' per-node values, kept from one build to the next (pure).

A :class:`NodeRows` (one per :class:`~xhpc.placement.snapshot.SnapshotBuilder`) keeps, per node
of the last build, what its columns are made of, and what it computed them from: the node
object, the jobs (their held GPUs per node) and the node's probe report. The inputs are
immutable (``NodeInfo``, ``JobInfo`` and ``ProbeReport`` are frozen), so an object handed back
by the next poll is known: only the nodes whose node object, jobs or report changed are
computed again; the rest of a build is a few numpy passes (a report's age against ``now``, the
reservations, the ranks).

What it holds of the inputs, and how it knows them again:

- nodes: the last build's nodes by name (the rows). Nodes given as the rows but for some objects
  (compared by identity, in one pass in C) of the same names, as the Slurm readers give them,
  have the same rows, and only the changed objects are read; if what is read of one is what
  was read (another reason, say), its row stands. Otherwise the rows are laid out again and
  all computed (a node added, removed or renamed; nodes not sorted by name).
- jobs: each job object, kept (keyed by ``id()`` while the object is held, so the key cannot
  name another object), with the GPUs it holds per node and how many times it is listed. A job
  list as long as the last build's: only the objects that differ at a place (by identity, in
  one pass in C) are counted in and out; otherwise the objects not known and those no longer
  listed (set differences of the ids, ~10x slower). GPUs are
  counted per node and index (two jobs naming one GPU stay apart); a node's row is computed
  again only if its set of held GPUs changed.
- probe reports: per node, the report last read and what it gave (taken_at, unclean GPUs,
  load); a new report object is read again (the same names in the same order: compared in
  one pass in C).

The rules are :mod:`xhpc.placement.snapshot`'s; the tests check that a build from these rows
equals a fresh one and the views' properties.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from itertools import compress, filterfalse
from operator import is_not, ne
from typing import Any

import numpy as np

from xhpc.models import HOLDING_STATES, GpuProbe, ProbeReport
from xhpc.placement.arrays import BoolArray, IntArray, SnapshotArrays, frozen
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.sources import (
    NO_JOBS,
    SlurmJobLike,
    SlurmNodeLike,
    is_foreign,
    unattributed_in,
)
from xhpc.placement.views import _fractions, _mean_load
from xhpc.slurm.parse import parse_gres

Parts = tuple[tuple[str, tuple[int, ...]], ...]  # (node, GPU indexes) a job holds
Readings = tuple[float | None, float | None, float | None]  # util_pct, mem_used_mb, mem_total_mb
Fractions = tuple[float | None, float | None]
ProbePart = tuple[int, bool, tuple[int, ...], float]  # taken_at (µs), lists GPUs, unclean, load
FloatArray = np.ndarray[Any, np.dtype[np.float64]]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
NodeStatic = tuple[int, int, tuple[int, ...]]  # gpus_total, gpus_used, gpus_used_idx
_INT_COLUMNS = ("idle", "adjust", "taken_us", "total", "part_code", "type_code")
_BOOL_COLUMNS = ("probed", "unclean", "usable")


class NodeRows:
    """Per-node values of the last build, in name order, and what they were computed from."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.index: dict[str, int] = {}
        self.nodes: list[SlurmNodeLike] = []  # per row (never changed: replaced)
        self._static: list[NodeStatic] = []  # per row: what is read of the node object
        self._jobs_in: tuple[SlurmJobLike, ...] = ()
        self._jobs: dict[int, list[Any]] = {}  # id -> [job, its Parts, times listed]
        self._repeats = False  # a job object listed more than once
        self._held: dict[str, dict[int, int]] = {}  # node -> GPU index -> jobs holding it
        self._reports: dict[str, ProbeReport] = {}  # the last build's (its own copy)
        self._probes: dict[str, tuple[ProbeReport, int, ProbePart]] = {}  # with the node's total
        self._ints: dict[str, IntArray] = {}
        self._bools: dict[str, BoolArray] = {}
        self._load: FloatArray = np.zeros(0)
        self._part_codes: dict[tuple[str, ...], int] = {}
        self._type_codes: dict[str | None, int] = {}
        self._masks: tuple[IntArray, IntArray, dict[str, BoolArray], dict[str, BoolArray]] | None
        self._masks = None
        self._ranks: tuple[BoolArray, FloatArray, IntArray] | None = None
        self._name_rank: IntArray = np.zeros(0, dtype=np.int64)

    # -- the inputs -> the rows to compute ------------------------------------------------------
    def update(
        self,
        nodes: Sequence[SlurmNodeLike],
        jobs: tuple[SlurmJobLike, ...],
        probes: dict[str, ProbeReport],
    ) -> None:
        """Bring the rows to these inputs, computing only the rows whose inputs changed."""
        renewed = self._nodes_changed(nodes)
        touched = self._jobs_changed(jobs)
        touched.update(self._probes_changed(probes))
        if renewed is None:
            rows: Sequence[int] = range(len(self.names))
            self._read_nodes(rows)
        else:
            dirty = self._read_nodes(sorted(renewed))
            dirty.update(r for r in map(self.index.get, touched) if r is not None)
            rows = sorted(dirty)
        self._compute(rows, probes)

    def _nodes_changed(self, nodes: Sequence[SlurmNodeLike]) -> set[int] | None:
        """The rows whose node object changed; None (all rows laid out again) unless the nodes
        are the last build's rows but for some objects (by identity, in one pass in C) of the
        same names: sorted by name, each name once, as the Slurm readers give them."""
        rows = self.nodes
        if len(nodes) == len(rows) and self._ints:
            changed = list(compress(range(len(nodes)), map(is_not, nodes, rows)))
            if all(nodes[k].name == self.names[k] for k in changed):
                if changed:  # (a new list: the last snapshot keeps the one it has)
                    self.nodes = list(nodes)
                return set(changed)
        last = {node.name: node for node in nodes}  # the last of a name wins
        names = sorted(last)
        n = len(names)
        self.names = tuple(names)
        self.index = dict(zip(names, range(n), strict=True))
        self.nodes = [last[name] for name in names]
        self._static = [(0, 0, ())] * n
        self._ints = {c: np.zeros(n, dtype=np.int64) for c in _INT_COLUMNS}
        self._bools = {c: np.zeros(n, dtype=np.bool_) for c in _BOOL_COLUMNS}
        self._load = np.zeros(n, dtype=np.float64)
        self._part_codes, self._type_codes = {}, {}
        self._masks = self._ranks = None
        self._name_rank = np.arange(n, dtype=np.int64)
        frozen(self._name_rank)
        return None

    def _jobs_changed(self, jobs: tuple[SlurmJobLike, ...]) -> set[str]:
        """Count the GPUs of the new job objects in, the gone ones' out; the nodes touched.

        The same list but for some objects (by identity, in one pass in C): only the objects at
        those places; else the objects not known / not listed any more (sets of ``id()`` of the
        listed objects and of the known ones, which are held)."""
        before, known = self._jobs_in, self._jobs
        delta: dict[int, int] = {}
        objects: dict[int, SlurmJobLike] = {}
        if len(jobs) == len(before):
            for k in compress(range(len(jobs)), map(is_not, jobs, before)):
                old, new = before[k], jobs[k]
                delta[id(old)] = delta.get(id(old), 0) - 1
                delta[id(new)] = delta.get(id(new), 0) + 1
                objects[id(new)] = new
        else:
            listed = dict(zip(map(id, jobs), jobs, strict=True))
            repeats = len(listed) != len(jobs)
            counts: Mapping[int, int] = Counter(map(id, jobs)) if repeats else {}
            for key in filterfalse(listed.__contains__, known):
                delta[key] = -known[key][2]
            for key in filterfalse(known.__contains__, listed):
                delta[key] = counts.get(key, 1)
                objects[key] = listed[key]
            if self._repeats or repeats:  # (times listed, of the objects listed before too)
                for key, known_entry in known.items():
                    if key in listed:
                        known_entry[2] = counts.get(key, 1)
            self._repeats = repeats
        self._jobs_in = jobs
        held = self._held
        held_before: dict[str, frozenset[int]] = {}  # the touched nodes' held GPUs before
        indexes_of: dict[str, tuple[int, ...]] = {}  # few distinct GRES strings
        for key, change in delta.items():
            entry = known.get(key)
            if entry is None:  # a new object (listed: change > 0)
                job = objects[key]
                parts = _job_parts(job, indexes_of)
                known[key] = [job, parts, change]
                step = 1
            else:
                entry[2] += change
                if entry[2] > 0:
                    continue
                del known[key]
                parts, step = entry[1], -1
            for host, indexes in parts:
                got = held.get(host)
                if host not in held_before:
                    held_before[host] = frozenset(got or ())
                counts_here = held[host] = {} if got is None else got
                for index in indexes:
                    left = counts_here.get(index, 0) + step
                    if left:
                        counts_here[index] = left
                    else:
                        del counts_here[index]
                if not counts_here:
                    del held[host]
        # (a job replaced by one holding the same GPUs changes no node)
        return {h for h, was in held_before.items() if was != held.get(h, NO_JOBS).keys()}

    def _probes_changed(self, probes: dict[str, ProbeReport]) -> set[str]:
        """The nodes whose report is another object than at the last build, or gone."""
        before, self._reports = self._reports, probes
        if len(probes) == len(before) and not any(map(ne, probes, before)):
            # the same nodes in the same order: compare the reports in one pass in C
            return set(compress(probes, map(is_not, probes.values(), before.values())))
        cache = self._probes
        changed = {name for name in cache if name not in probes}
        for name in changed:
            del cache[name]
        for name, report in probes.items():
            got = cache.get(name)
            if got is None or got[0] is not report:
                changed.add(name)
        return changed

    # -- rows -----------------------------------------------------------------------------------
    def _read_nodes(self, rows: Sequence[int]) -> set[int]:
        """What is read of these rows' node objects; the rows where that changed."""
        nodes, static = self.nodes, self._static
        ints, usable_before = self._ints, self._bools["usable"]
        changed: set[int] = set()
        part_codes, type_codes = self._part_codes, self._type_codes
        usable_of: dict[tuple[str, tuple[str, ...]], bool] = {}  # few distinct states
        totals: list[int] = []
        parts: list[int] = []
        types: list[int] = []
        usables: list[bool] = []
        for r in rows:
            node = nodes[r]
            read = (node.gpus_total, node.gpus_used, node.gpus_used_idx)
            state = (node.state, node.state_flags)
            usable = usable_of.get(state)
            if usable is None:
                usable = usable_of[state] = node.usable
            part = part_codes.setdefault(node.partitions, len(part_codes))
            gtype = type_codes.setdefault(node.gpu_type, len(type_codes))
            if (
                read == static[r]
                and part == ints["part_code"][r]
                and gtype == ints["type_code"][r]
                and usable == usable_before[r]
            ):
                continue  # (another object, the same values: its reason, say)
            static[r] = read
            changed.add(r)
            totals.append(read[0])
            parts.append(part)
            types.append(gtype)
            usables.append(usable)
        at = sorted(changed)
        if at:
            ints["total"][at] = totals
            ints["part_code"][at] = parts
            ints["type_code"][at] = types
            self._bools["usable"][at] = usables
        return changed

    def _compute(self, rows: Sequence[int], probes: Mapping[str, ProbeReport]) -> None:
        """Each row's values (:meth:`Sources._build_view`'s rules, counted instead of built): a
        GPU is idle when neither held (by a job's IDX, in range) nor unattributed; a fresh
        probe's unclean GPUs among the idle ones are ``adjust``."""
        names, static, held, cache = self.names, self._static, self._held, self._probes
        ranges: dict[int, frozenset[int]] = {}  # gpus_total -> its indexes
        fractions: dict[Readings, Fractions] = {}  # few distinct readings
        idles: list[int] = []
        adjusts: list[int] = []
        takens: list[int] = []
        probed: list[bool] = []
        uncleans: list[bool] = []
        loads: list[float] = []
        for r in rows:
            name = names[r]
            total, used, used_idx = static[r]
            held_here = held.get(name) or NO_JOBS
            n_held = 0
            if held_here:
                keys = held_here.keys()
                indexes = ranges.get(total)
                if indexes is None:
                    indexes = ranges[total] = frozenset(range(total))
                n_held = len(keys) if keys <= indexes else len(keys & indexes)
            unattributed: Collection[int] = ()
            if used_idx or used > n_held:
                unattributed = unattributed_in(total, used, used_idx, held_here)
            idles.append(total - n_held - len(unattributed))
            probe = probes.get(name)
            if probe is None:
                adjusts.append(0)
                takens.append(0)
                probed.append(False)
                uncleans.append(False)
                loads.append(0.0)
                continue
            got = cache.get(name)
            if got is None or got[0] is not probe or got[1] != total:
                got = cache[name] = (probe, total, _probe_part(probe, total, fractions))
            taken_us, lists_gpus, unclean, load = got[2]
            adjust = 0
            for index in unclean:
                if index not in held_here and index not in unattributed:
                    adjust += 1
            adjusts.append(adjust)
            takens.append(taken_us)
            probed.append(lists_gpus)
            uncleans.append(bool(unclean))
            loads.append(load)
        if rows:
            self._ints["idle"][rows] = idles
            self._ints["adjust"][rows] = adjusts
            self._ints["taken_us"][rows] = takens
            self._bools["probed"][rows] = probed
            self._bools["unclean"][rows] = uncleans
            self._load[rows] = loads

    # -- the rows -> the arrays -----------------------------------------------------------------
    def arrays(
        self, reserved: Mapping[str, int], now: datetime, probe_ttl_s: float
    ) -> tuple[SnapshotArrays, IntArray]:
        """The placement arrays at ``now``, and each node's free count before reservations."""
        ints, bools, n = self._ints, self._bools, len(self.names)
        now_us = (now - _EPOCH) // _US
        age_s = (now_us - ints["taken_us"]) / 1_000_000  # == (now - taken_at).total_seconds()
        fresh = bools["probed"] & ~(np.maximum(age_s, 0.0) > probe_ttl_s)
        unreserved = ints["idle"] - np.where(fresh, ints["adjust"], 0)
        held_back = np.zeros(n, dtype=np.int64)
        for name, count in reserved.items():
            r = self.index.get(name)
            if r is not None:
                held_back[r] = count
        free = np.maximum(unreserved - held_back, 0)
        tainted = fresh & bools["unclean"]
        load = np.where(fresh, self._load, 0.0)
        usable = bools["usable"].copy()
        total = ints["total"].copy()
        for array in (unreserved, free, tainted, load, usable, total):
            frozen(array)
        partitions, gpu_types = self._group_masks()
        return (
            SnapshotArrays(
                names=self.names,
                index=self.index,
                free=free,
                usable=usable,
                tainted=tainted,
                load=load,
                name_rank=self._name_rank,
                idle_rank=self._idle_rank(tainted, load),
                partitions=partitions,
                gpu_types=gpu_types,
                max_gpus=max(0, int(ints["total"].max())) if n else 0,
                total=total,
            ),
            unreserved,
        )

    def _idle_rank(self, tainted: BoolArray, load: FloatArray) -> IntArray:
        """Rank by (tainted, load, name); the last build's if those are the same."""
        ranks = self._ranks
        same = ranks is not None and np.array_equal(ranks[0], tainted)
        if ranks is not None and same and np.array_equal(ranks[1], load):
            return ranks[2]
        n = len(self.names)
        rank = np.empty(n, dtype=np.int64)
        rank[np.lexsort((self._name_rank, load, tainted))] = np.arange(n, dtype=np.int64)
        frozen(rank)
        self._ranks = (tainted, load, rank)
        return rank

    def _group_masks(self) -> tuple[dict[str, BoolArray], dict[str, BoolArray]]:
        """One mask per partition and per GPU type; the last build's if no node moved."""
        part, gtype = self._ints["part_code"], self._ints["type_code"]
        masks = self._masks
        same = masks is not None and np.array_equal(masks[0], part)
        if masks is not None and same and np.array_equal(masks[1], gtype):
            return masks[2], masks[3]
        partitions: dict[str, BoolArray] = {}
        for parts, code in self._part_codes.items():
            members = part == code
            if not members.any():
                continue
            for name in parts:
                mask = partitions.get(name)
                partitions[name] = members if mask is None else mask | members
        gpu_types = {
            key: gtype == code for key, code in self._type_codes.items() if key is not None
        }
        gpu_types = {key: mask for key, mask in gpu_types.items() if mask.any()}
        for mask in (*partitions.values(), *gpu_types.values()):
            frozen(mask)
        self._masks = (part.copy(), gtype.copy(), partitions, gpu_types)
        return partitions, gpu_types


def _job_parts(job: SlurmJobLike, indexes_of: dict[str, tuple[int, ...]]) -> Parts:
    """The (node, GPU indexes) a job holds: its gres_detail aligned with its nodes (the rules
    of :func:`~xhpc.placement.sources.job_gpus`)."""
    details = job.gres_detail
    if not details:
        return ()
    state = job.state
    if state not in HOLDING_STATES and state.upper() not in HOLDING_STATES:
        return ()
    text = job.nodes
    if len(details) == 1 and text and text.isalnum() and (len(text) != 4 or text.lower() != "none"):
        indexes = indexes_of.get(details[0])
        if indexes is None:
            indexes = indexes_of[details[0]] = parse_gres(details[0])[2]
        return ((text, indexes),)
    hosts = expand_hostlist(text) or ((job.batch_host,) if job.batch_host else ())
    if len(hosts) == len(details):
        return tuple((h, parse_gres(d)[2]) for h, d in zip(hosts, details, strict=True))
    if len(hosts) == 1:
        return ((hosts[0], job.gpus_idx),)
    return ()  # cannot align details with nodes: sinfo's used counts cover these GPUs


def _probe_part(probe: ProbeReport, total: int, fractions: dict[Readings, Fractions]) -> ProbePart:
    """What a probe report adds to its node's columns: (taken_at in microseconds since the epoch,
    lists GPUs, unclean indexes, load) over the node's ``total`` GPUs (the last row of an index
    wins, as in the views)."""
    taken_us = (probe.taken_at - _EPOCH) // _US  # (a naive time raises here, as age_s does)
    gpus: Sequence[GpuProbe] = probe.gpus
    for i, gpu in enumerate(gpus):
        if gpu.index != i:  # not the usual rows 0, 1, 2, ...: by index, the last row wins
            seen = {g.index: g for g in gpus}
            gpus = [seen[i] for i in range(total) if i in seen]
            break
    else:
        if len(gpus) > total:
            gpus = gpus[:total]
    unclean: list[int] = []
    utils: list[float] = []
    mems: list[float] = []
    for gpu in gpus:  # in index order, as the views' load reads them
        readings = (gpu.util_pct, gpu.mem_used_mb, gpu.mem_total_mb)
        util, mem = fractions.get(readings) or fractions.setdefault(readings, _fractions(*readings))
        if util is not None:
            utils.append(util)
        if mem is not None:
            mems.append(mem)
        if not gpu.healthy or (gpu.processes and is_foreign(gpu)):
            unclean.append(gpu.index)
    return taken_us, bool(probe.gpus), tuple(unclean), _mean_load(utils, mems)
