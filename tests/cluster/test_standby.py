"""Active and standby brokers on the dev cluster (``xhpc broker --standby``, one state): with a
deployment serving and calls running through the gateway, the leader killed (SIGKILL) and the
standby leads within seconds: the same replica on the same job, READY, no call lost, and it
acts (a scale-up serves). Then the new leader frozen past its lease (SIGSTOP): a standby started
meanwhile leads, and the frozen one, resumed, stops with a one-line error, having submitted no
job: the deployment's jobs are the ones the leaders made, each once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.cluster.test_autoscale_chaos import Calls
from tests.cluster.test_chaos import replicas
from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import Xhpc, freeze_until_taken_over, own_xhpc, wait_for

pytestmark = pytest.mark.cluster


def _log(x: Xhpc, name: str) -> str:
    return (x.state_dir / f"{name}.log").read_text(errors="replace")


def _ready(x: Xhpc, name: str) -> list[tuple[str, str]]:
    return sorted((r["replica_id"], str(r["job_id"])) for r in replicas(x, name)
                  if r["state"] == "READY")  # fmt: skip


def test_the_standby_leads_when_the_leader_dies_or_freezes_and_nothing_is_lost(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    name = unique_name
    with own_xhpc(tiny_model, ECHO_ENGINE + "\n[broker]\nlease_s = 3\n") as x:
        x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--timeout", "120")
        before = _ready(x, name)
        assert len(before) == 1
        first = x.procs[0]
        second = x.start("broker", "--standby", log_name="standby")
        wait_for(lambda: "standby: broker" in _log(x, "standby"), 30, "the standby waiting")
        calls = Calls(x, name)
        calls.start()
        try:
            wait_for(lambda: len(calls.answers) >= 5, 30, "calls answered")
            # The leader is killed: the standby leads (its lease's holder is gone from this host).
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            x.procs.remove(first)
            killed = time.monotonic()
            wait_for(lambda: "standby takes over" in _log(x, "standby"), 15, "the standby leading")
            assert time.monotonic() - killed < 10
            wait_for(lambda: _ready(x, name) == before, 60, "the same replica READY on its job")
            x.run("scale", name, "2")  # the new leader acts
            wait_for(lambda: len(_ready(x, name)) == 2, 120, "a second replica READY")
            after = time.monotonic()
            wait_for(lambda: sum(1 for b, _, w in calls.answers if b > after and not w) >= 5, 60,
                     "calls answered after the takeover")  # fmt: skip
            jobs = sorted(j for _, j in _ready(x, name))

            # The new leader frozen past its lease: a third broker, standing by, leads; the
            # frozen one, resumed, is fenced and stops, having submitted nothing.
            x.start("broker", "--standby", log_name="third")
            wait_for(lambda: "standby: broker" in _log(x, "third"), 30, "the third waiting")
            assert freeze_until_taken_over(second, lambda: _log(x, "third")) < 10
            second.send_signal(signal.SIGCONT)
            assert second.wait(30) == 4
            assert "lost its lease" in _log(x, "standby").strip().splitlines()[-1]
            x.procs.remove(second)
            wait_for(lambda: sorted(j for _, j in _ready(x, name)) == jobs, 60,
                     "both replicas READY on their jobs under the third leader")  # fmt: skip
            assert sorted(x.my_jobs()) == jobs  # no job submitted twice, none lost
            again = time.monotonic()
            wait_for(lambda: sum(1 for b, _, w in calls.answers if b > again and not w) >= 5, 60,
                     "calls answered under the third leader")  # fmt: skip
        finally:
            calls.stop.set()
            calls.join(150)
        assert calls.failures() == [], calls.failures()[:3]
        x.run("stop", name)
        x.wait_no_jobs(120)
