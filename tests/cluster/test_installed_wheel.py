"""Other users run the installed wheel, never this checkout (which may sit in root's 0700 home).

The wheel carries everything a job needs (the job templates, the packaged defaults); a second Unix
user renders a job script with it, and nothing they run names a path inside the checkout."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import ROOT, as_uid, needs_other_users, xhpc_as

pytestmark = [pytest.mark.cluster, needs_other_users]
OTHER_UID = 4243  # a uid with no account and no home

RENDER = """
import json, sys, xhpc, xhpc.render as r
p = r.SbatchParams(replica_id="m-0", deployment="m", job_name="xhpc-m-0", comment="xhpc:b:m:m-0",
                   gpus=1, time="00:10:00", output="/tmp/o-%j", agent_python=sys.executable,
                   replica_dir="/tmp/r")
print(json.dumps({"package": xhpc.__file__, "script": r.render_sbatch(p),
                  "path": sys.path, "flags": [sys.flags.isolated]}))
"""


def test_what_another_user_runs_comes_from_the_installed_wheel() -> None:
    argv, env = xhpc_as(OTHER_UID)
    for word in [*argv, *env.values()]:
        assert not word.startswith(str(ROOT)), f"{word} is inside the checkout"
    python = str(argv[0]).replace("/bin/xhpc", "/bin/python")
    done = subprocess.run(
        [*as_uid(OTHER_UID), python, "-I", "-c", RENDER],
        env={"HOME": "/tmp", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60, cwd="/tmp",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert not seen["package"].startswith(str(ROOT)), seen["package"]
    assert "site-packages" in seen["package"]
    assert not any(p.startswith(str(ROOT)) for p in seen["path"]), seen["path"]
    assert seen["flags"] == [1]
    assert "-I -m xhpc.agent /tmp/r" in seen["script"]  # the job's Python runs isolated too
    version = subprocess.run(
        [*as_uid(OTHER_UID), *argv, "--version"], env={"HOME": "/tmp", **env},
        capture_output=True, text=True, timeout=60, cwd="/tmp",
    )  # fmt: skip
    assert version.returncode == 0 and "xhpc" in version.stdout.lower(), version.stderr
