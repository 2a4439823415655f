"""`xhpc doctor --site`: checks of the Slurm site xhpc serves on (docs/operators.md).

``verdicts`` turns what Slurm, the engines' environments and a short job on a compute node
reported into one verdict per check (pure); ``node`` is what that job runs; ``run`` gathers it
all, each check with its own timeout (the Slurm client and the runner).
"""
