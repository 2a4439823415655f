"""One error tree for xhpc.

    XhpcError                      every error xhpc raises on purpose (exit 1 unless overridden)
    ├── ConfigError                a config file or value is wrong (exit 2)
    ├── ValidationError            a request is invalid; nothing was submitted (exit 2)
    │   └── AdmissionError         a request does not fit the cluster; lists every problem (exit 2)
    ├── NotFoundError              a model, deployment or replica does not exist (exit 3)
    ├── StateTransitionError       an illegal replica state change
    ├── SlurmError                 a Slurm command failed (carries argv, rc, stdout, stderr)
    │   ├── SlurmTimeoutError      it ran past its timeout and was killed: it may have acted
    │   └── SlurmParseError        Slurm printed something we cannot parse
    ├── BrokerUnavailableError     the broker cannot be reached (exit 4)
    ├── BrokerError                the broker answered with an error
    ├── EngineError                an inference engine failed to start or answer
    │   └── UnsafePathError        a node-local directory or file is not privately ours
    │                              (carries its path, the owner uid found and the mode)
    └── RemoteError                SSH to the login node failed: connection, host key,
        │                          authentication (exit 255, as ssh's own)
        └── HostKeyError           the login node's host key is unknown or does not match

Each error keeps its evidence as attributes and may carry a ``hint`` for the user. Its
``error_type`` is the OpenAI error type it is shown as in an error object (:func:`error_body`:
the gateway's answers and the CLI's ``--json`` output share that one shape).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `xhpc --help` imports no pydantic
    from pydantic import ValidationError as PydanticValidationError


class XhpcError(Exception):
    exit_code = 1
    code = "xhpc_error"
    error_type = "server_error"  # the OpenAI error type of its error object

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = " ".join(self.message.split())
        if self.hint:
            text += f" (hint: {' '.join(self.hint.split())})"
        return text


class ConfigError(XhpcError):
    exit_code = 2
    code = "config_error"
    error_type = "invalid_request_error"


class ValidationError(XhpcError):
    exit_code = 2
    code = "invalid_request"
    error_type = "invalid_request_error"


class AdmissionError(ValidationError):
    code = "admission_failed"

    def __init__(self, problems: Sequence[str], *, hint: str | None = None) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems), hint=hint)


class NotFoundError(XhpcError):
    exit_code = 3
    code = "not_found"
    error_type = "not_found_error"


class StateTransitionError(XhpcError):
    code = "illegal_transition"

    def __init__(self, replica_id: str, current: str, target: str, what: str = "replica") -> None:
        self.replica_id = replica_id
        self.current = current
        self.target = target
        super().__init__(f"{what} {replica_id}: illegal transition {current} -> {target}")


class SlurmError(XhpcError):
    code = "slurm_error"

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
        hint: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        if detail:
            message = f"{message}: {detail}"
        super().__init__(message, hint=hint)


class SlurmTimeoutError(SlurmError):
    """The command was killed at its timeout: what it asked Slurm for may still have happened
    (an ``sbatch`` killed after slurmctld accepted the job leaves a job with no id known)."""

    code = "slurm_timeout"


class SlurmParseError(SlurmError):
    code = "slurm_parse_error"


class BrokerUnavailableError(XhpcError):
    exit_code = 4
    code = "broker_unavailable"
    error_type = "service_unavailable"

    def __init__(
        self, message: str, *, hint: str | None = None, state_dir: Path | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.state_dir = state_dir  # where its socket was looked for (None: over TCP)


class FencedError(XhpcError):
    """This broker's lease was taken by another (it was paused, or cut off, past its lease):
    it may neither write the state nor call Slurm (xhpc.store.lease)."""

    exit_code = 4
    code = "broker_fenced"
    error_type = "service_unavailable"


class BrokerError(XhpcError):
    code = "broker_error"

    def __init__(self, message: str, *, status: int, code: str = "broker_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        if status == 403:
            self.error_type = "permission_error"


class EngineError(XhpcError):
    code = "engine_error"


class UnsafePathError(EngineError):
    """A directory or file on a node that xhpc makes or uses (the weights cache, a job's GPU
    claims, an engine's scratch directory) is not what it must be: a symlink, another user's,
    or writable by others. It is refused as found: never used, never removed."""

    code = "unsafe_path"

    def __init__(
        self, message: str, *, path: Path, owner_uid: int | None, mode: int | None
    ) -> None:
        super().__init__(
            message,
            hint="another user of the node may have made it first: remove it if it is yours, "
            "or point the setting (TMPDIR, [cache] local_dir) at a directory of your own",
        )
        self.path = path
        self.owner_uid = owner_uid
        self.mode = mode


class RemoteError(XhpcError):
    """The SSH connection to the login node failed (not the command run there: its own exit
    code is passed through). 255, as ssh's own, so a script can tell them apart."""

    exit_code = 255
    code = "remote_error"

    def __init__(self, message: str, *, destination: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.destination = destination


class HostKeyError(RemoteError):
    """The server's host key is not in known_hosts (``expected`` is None) or differs from the
    one there: nothing was sent to it."""

    code = "host_key_error"

    def __init__(
        self,
        message: str,
        *,
        destination: str,
        fingerprint: str,
        expected: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, destination=destination, hint=hint)
        self.fingerprint = fingerprint
        self.expected = expected


ERRORS_BY_CODE: dict[str, type[XhpcError]] = {
    cls.code: cls
    for cls in (
        XhpcError,
        ConfigError,
        ValidationError,
        AdmissionError,
        NotFoundError,
        StateTransitionError,
        SlurmError,
        SlurmTimeoutError,
        BrokerUnavailableError,
        EngineError,
    )
}


def error_body(
    message: str, *, type_: str, code: str, param: str | None = None
) -> dict[str, dict[str, str | None]]:
    """The one error object: the OpenAI API's shape, which the gateway answers and the CLI
    prints on stdout under ``--json``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# What pydantic puts before a validator's own message: "Value error, invalid ...".
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def plain_message(msg: str) -> str:
    """A pydantic error message as a plain sentence: without its "Value error, " prefix."""
    for prefix in _PYDANTIC_PREFIXES:
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


def json_object(text: str, what: str) -> dict[str, object]:
    """``text`` as a JSON object (a command line's option), or a one-line ValidationError
    naming ``what``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValidationError(f"{what}: not valid JSON ({err.msg})") from err
    if not isinstance(data, dict):
        raise ValidationError(f"{what}: a JSON object is needed")
    return {str(k): v for k, v in data.items()}


def first_problem(err: PydanticValidationError, what: str) -> ValidationError:
    """A pydantic failure as one line: ``what: FIELD: message`` (its first error)."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return ValidationError(f"{what}: {where}: {plain_message(first['msg'])}")
