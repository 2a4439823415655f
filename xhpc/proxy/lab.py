"""A lab gateway's brokers (decision 0014): what each one sent, who runs it, and the one routing
table and access list the gateway serves from them.

Each member runs their own broker; the gateway reads every broker in ``[proxy] brokers``. A
broker's models belong to the Unix user it runs as, read from the peer credentials of the
connection its table came on (``xhpc.proxy.broker_call``), never from what it says; its grants
count only when they came from that same uid. Model names are one namespace: a name two
brokers list goes to the first in configuration order. The first broker is the key authority:
API keys (and usage) are its alone; a member broker's grants give only the accounts its own
models are shared with. With one broker nothing is merged: its table and grants are served as
they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xhpc.access import Grants, ModelAccess
from xhpc.models import RoutingTable


@dataclass
class BrokerLink:
    """One broker the gateway reads."""

    socket_path: Path
    table: RoutingTable | None = None  # what it last sent
    uid: int | None = None  # who sent ``table``: the peer credentials of its connection
    user: str | None = None  # that uid's Unix user: the owner of its models
    access: tuple[ModelAccess, ...] = ()  # its grants' access list (a member broker's)
    access_uid: int | None = None  # who sent ``access``: it counts only if ``uid`` did too
    failures: int = 0  # consecutive failed refreshes
    epoch: int = 0  # the highest lease token its tables carried
    epoch_at: float = 0.0  # when a table of that token last came (monotonic)


@dataclass(frozen=True)
class Conflict:
    model: str
    kept: int  # the broker (index) that serves the name
    ignored: int  # a later broker that lists it too


@dataclass(frozen=True)
class LabTable:
    table: RoutingTable
    broker_of: dict[str, int] = field(default_factory=dict)  # model -> the broker serving it
    conflicts: tuple[Conflict, ...] = ()


def merge(links: Sequence[BrokerLink]) -> LabTable:
    """One routing table from what every broker sent (a broker not heard from yet adds
    nothing). Its version is a digest of theirs: equal inputs, equal versions."""
    broker_of: dict[str, int] = {}
    conflicts: list[Conflict] = []
    for i, link in enumerate(links):
        if link.table is None:
            continue
        for model in sorted({*link.table.models, *(r.model for r in link.table.routes)}):
            kept = broker_of.setdefault(model, i)
            if kept != i:
                conflicts.append(Conflict(model, kept, i))
    if len(links) == 1:
        return LabTable(links[0].table or RoutingTable(), broker_of)
    routes = tuple(
        route
        for i, link in enumerate(links)
        if link.table is not None
        for route in link.table.routes
        if broker_of.get(route.model) == i
    )
    versions = ",".join(str(link.table.version if link.table else "-") for link in links)
    version = int(hashlib.sha256(versions.encode()).hexdigest()[:8], 16)
    table = RoutingTable(version=version, models=tuple(sorted(broker_of)), routes=routes)
    return LabTable(table, broker_of, tuple(conflicts))


def lab_grants(authority: Grants, links: Sequence[BrokerLink], broker_of: dict[str, int]) -> Grants:
    """The keys of the first broker; each model's owner and account from the broker serving
    it, a member broker's models owned by the user it runs as (none known: admins only) and
    shared with the accounts its grants name, if the uid that sent them sent its routes too."""
    if len(links) <= 1:
        return authority
    access = [a for a in authority.access if broker_of.get(a.model, 0) == 0]
    for model, i in sorted(broker_of.items()):
        if i == 0:
            continue
        link = links[i]
        told = link.access if link.access_uid == link.uid else ()  # one uid sent both
        account = next((a.account for a in told if a.model == model), None)
        access.append(ModelAccess(model=model, owner=link.user, account=account))
    return Grants(keys=authority.keys, access=tuple(access))
