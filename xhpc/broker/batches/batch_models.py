"""What a batch may name as its model, and who may send an online batch to a deployment.

A batch names a catalog model (a job array serves the catalog's weights), a deployment its
caller may use (the deployment's weights; ``--online``: its READY replicas), or, for a caller
on the control socket acting as itself, a local model directory as ``xhpc serve`` takes one.
A caller the gateway acts for (a key's user: ``Caller.delegated``) never names a path: the
broker would read it with its own user's rights, and whether it exists must not show. Every
model such a caller may not name gets one answer, ``unknown model``, whatever is (or is not)
on disk or in the store.

Who may use a deployment is ``xhpc.access.caller_may_use`` on its ``ModelAccess``: its owner,
keys of the account it is charged to, admins.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from xhpc.access import Caller, ModelAccess, caller_may_use
from xhpc.catalog import ResolvedModel, resolve_model
from xhpc.errors import NotFoundError
from xhpc.ids import IdKind, valid
from xhpc.records import DeploymentRecord
from xhpc.settings import XhpcConfig

HINT = "a batch names a catalog model or a deployment you may use"


def unknown_model(model: str) -> NotFoundError:
    """The one refusal of a model a delegated caller may not name (no oracle)."""
    shown = model[:80] if model.isprintable() else repr(model[:80])
    return NotFoundError(f"unknown model {shown!r}", hint=HINT)


def batch_model(
    model: str,
    caller: Caller | None,
    config: XhpcConfig,
    access: Mapping[str, ModelAccess],
    deployment: Callable[[str], DeploymentRecord | None],
) -> ResolvedModel:
    """The weights and engine a job-array batch of ``caller`` serves for ``model``.
    ``access``: the live deployments' owners and accounts; ``deployment``: a live one's
    record by name."""
    delegated = caller is not None and caller.delegated
    if delegated and not valid(IdKind.NAME, model):
        raise unknown_model(model)  # a path, or anything else: never looked at
    if model not in config.models and model in access:
        if not caller_may_use(caller, access[model]):
            raise unknown_model(model)
        record = deployment(model)
        if record is None:
            raise unknown_model(model)
        path = Path(record.model_path)
        return ResolvedModel(name=model, path=path, engine=record.engine, from_catalog=False)
    if delegated and model not in config.models:
        raise unknown_model(model)
    return resolve_model(model, config)


def check_online(model: str, caller: Caller | None, access: Mapping[str, ModelAccess]) -> None:
    """NotFoundError unless ``caller`` may send an online batch to deployment ``model``
    (another member's deployment, and its engine secret, are not the caller's to use)."""
    if not caller_may_use(caller, access.get(model)):
        shown = model[:80] if model.isprintable() else repr(model[:80])
        raise NotFoundError(
            f"no deployment {shown!r} you may use",
            hint="an online batch goes to a deployment of yours or of your key's account",
        )
