"""Keys tied to Slurm identity: a key's user is a Unix user, and its account one that Slurm
accounting lets that user use (an association of this cluster), checked when the key is made.

Without accounting (``AccountingStorageType=accounting_storage/none``) Slurm knows no
associations: the account stays a free label, and the key's creation says so.
"""

from __future__ import annotations

import pwd
from collections.abc import Callable

from xhpc.access import KeyCreate
from xhpc.errors import ValidationError
from xhpc.slurm.client import SlurmClient


def unix_user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def unchecked_account(account: str) -> str:
    return (
        f"Slurm keeps no accounting here (AccountingStorageType=accounting_storage/none): "
        f"account {account!r} is a free label, not checked against Slurm associations"
    )


async def check_key_identity(
    req: KeyCreate,
    slurm: SlurmClient,
    accounting: bool,
    user_exists: Callable[[str], bool] = unix_user_exists,
) -> str | None:
    """Refuse (ValidationError, a 400) a key whose user is no Unix user, or whose account is
    not one of that user's Slurm associations on this cluster. Returns a warning when the
    account could not be checked (no accounting), else None. A key without an account is
    charged to none (it reaches its user's own models only): only its user is checked."""
    if not user_exists(req.user):
        raise ValidationError(
            f"no Unix user {req.user!r}: a key belongs to an existing user",
            hint="give --user the login name of a lab member (getent passwd NAME)",
        )
    if req.account is None:
        return None
    if not accounting:
        return unchecked_account(req.account)
    accounts = await slurm.user_accounts(req.user)
    if req.account not in accounts:
        theirs = ", ".join(accounts) if accounts else "none"
        raise ValidationError(
            f"user {req.user!r} may not use Slurm account {req.account!r} "
            f"(their associations on this cluster: {theirs})",
            hint=f"pick one of theirs, or: sacctmgr add user {req.user} account={req.account}",
        )
    return None
