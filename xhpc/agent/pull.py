"""A pull into the site's shared model store: what ``xhpc cache pull MODEL --from DIR`` runs in its
Slurm job (``python -m xhpc.agent.staging pull SOURCE MODELS_DIR MODEL RESULT [--replace]``).

The source must be a directory of regular files with a ``config.json`` (symlinks and special
files are refused before anything is copied). Under ``<models_dir>/.<model>.lock`` the job digests
the source (``xhpc.weights``); a destination that already holds that content is left as it is,
one that holds anything else is refused unless ``replace``. The copy goes to a temporary
directory beside the destination, is digested again (a source changed while it was copied, or a
symlink that appeared, fails the pull and replaces nothing) and is renamed into place: the
destination is the old copy or the whole new one, never a part. With ``replace`` the old copy
is first moved into that temporary directory and removed with it (put back if the rename fails).

The job's result (:class:`xhpc.weights.PullResult`, also on failure) goes to RESULT, written to
a temporary file and renamed, owner-only: the broker reads it at its next reconcile and records
the copy in the ledger.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from xhpc.agent.staging import model_lock
from xhpc.models import check_name
from xhpc.weights import PullResult, WeightsError, digest_of, file_entries, tree_digest

USAGE = "usage: python -m xhpc.agent.staging pull SOURCE MODELS_DIR MODEL RESULT [--replace]"


def _check_source(source: Path) -> None:
    try:
        mode = os.lstat(source / "config.json").st_mode
    except OSError:
        mode = 0
    if not stat.S_ISREG(mode):
        raise WeightsError(f"{source} has no config.json: not a Hugging Face-format model")


def _held(dest: Path) -> str | None:
    """The digest of what ``dest`` holds; None when it holds nothing digestible."""
    try:
        return tree_digest(dest)[0]
    except WeightsError:
        return None


def pull(source: Path, models_dir: Path, model: str, *, replace: bool = False) -> PullResult:
    """Copy ``source`` to ``<models_dir>/<model>``, checked by digest and renamed into place."""
    try:
        check_name(model, "model name")
    except ValueError as err:
        raise WeightsError(str(err)) from err
    if not models_dir.is_dir():
        raise WeightsError(f"the shared model store {models_dir} is not a directory")
    entries = file_entries(source)  # refuses symlinks and special files, copies nothing
    _check_source(source)
    digest, size = digest_of(entries), sum(e.size for e in entries)
    dest = models_dir / model
    done = PullResult(model=model, path=str(dest), size_bytes=size, digest=digest)
    with model_lock(models_dir, model, owned=False):  # the site's store: a plain file suffices
        if os.path.lexists(dest):
            held = _held(dest)
            if held == digest:
                return done.model_copy(update={"unchanged": True})
            if not replace:
                what = f"other weights ({held})" if held else "something that is no plain copy"
                raise WeightsError(f"{dest} holds {what}: pass --replace to overwrite it")
        tmp = Path(tempfile.mkdtemp(prefix=f".{model}.pull-", dir=models_dir))
        try:
            copied = tmp / "w"
            shutil.copytree(source, copied, symlinks=True)  # a link is copied as one, then refused
            if tree_digest(copied)[0] != digest:
                raise WeightsError(
                    f"the copy of {source} does not match its digest (changed while it was "
                    "copied?): nothing was replaced"
                )
            old = tmp / "old"
            replaced = os.path.lexists(dest)
            if replaced:
                os.rename(dest, old)
            try:
                os.rename(copied, dest)
            except OSError:
                if replaced:
                    os.rename(old, dest)
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return done.model_copy(update={"replaced": replaced})


def write_result(path: Path, result: PullResult) -> None:
    """``result`` as JSON at ``path`` (owner-only), whole or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(result.model_dump_json())
    os.rename(tmp, path)


def main(argv: Sequence[str]) -> int:
    """``SOURCE MODELS_DIR MODEL RESULT [--replace]`` (after ``pull``)."""
    args = [a for a in argv if a != "--replace"]
    if len(args) != 4:
        print(USAGE, file=sys.stderr)
        return 2
    source, models_dir, model, result_path = Path(args[0]), Path(args[1]), args[2], Path(args[3])
    try:
        result = pull(source, models_dir, model, replace="--replace" in argv)
    except (WeightsError, OSError) as err:
        message = (
            err.message if isinstance(err, WeightsError) else f"{err.strerror}: {err.filename}"
        )
        result = PullResult(
            model=model[:63], path=str(models_dir / model)[:4096], error=message[:2000]
        )
    write_result(result_path, result)
    if result.error is not None:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    verb = "unchanged" if result.unchanged else "replaced" if result.replaced else "copied"
    print(f"{verb}: {result.path} {result.digest}")
    return 0
