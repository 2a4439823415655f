"""What Slurm, the probes and the jobs say, and what the broker makes of it: the poller,
reconciliation, sweeps, orphans, GPU hours, probes, replica logs, drains, lifecycle rules.
"""
