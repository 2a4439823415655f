"""The continuity benchmark's fixed figures: the scenarios (their ``--only`` names and row
labels, the short set, the one without traffic), how often the broker and squeue are sampled,
how long the outages last, the targets, the model and engine it serves, and its log line.
"""

from __future__ import annotations

from bench._common import ROOT, logger

MODEL_DIR = ROOT / "models" / "tiny-llama"
TRANSFORMERS_PY = ROOT / ".venvs" / "transformers" / "bin" / "python"

POLL_S = 0.2  # the broker's routes and replicas
JOB_POLL_S = 1.0  # squeue, for this state directory's jobs
CTLD_DOWN_S = 60.0
BROKER_DOWN_S = 30.0
# After a broker restart, heartbeats are judged only after heartbeat_timeout_s (15 s on the dev
# cluster) + lifecycle.restart_grace_s (30 s): watch past that, with a margin.
BROKER_SETTLE_S = 60.0
LEAK_WAIT_S = 90.0
TARGET_NODE_ROTATION_S = 5.0
# node loss: the replacement READY within its own queue wait + engine start + this
TARGET_NODE_RESTORE_EXTRA_S = 5.0
TARGET_CRASH_ATTEMPTS = 3
WALLTIME_HANDOVERS = 2

# name, row label, replicas served, jobs the scenario needs beyond one per replica served
SCENARIOS: tuple[tuple[str, str], ...] = (
    ("engine-kill", "engine SIGKILL"),
    ("requeue", "scontrol requeue"),
    ("proxy-worker-kill", "proxy worker kill -9"),
    ("proxy-reload", "proxy reload (SIGHUP)"),
    ("broker-kill", "broker kill -9, down"),
    ("preemption", "preemption (urgent job)"),
    ("node-loss", "node loss (node-fail)"),
    ("ctld-outage", "slurmctld down 60 s"),
    ("walltime", "walltime boundary x2"),
    ("crash-loop", "crash loop"),
)
NAMES = tuple(n for n, _ in SCENARIOS)
LABELS = dict(SCENARIOS)
SHORT = ("engine-kill", "requeue")
NO_TRAFFIC = frozenset({"crash-loop"})

log = logger("continuity")
