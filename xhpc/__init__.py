"""xhpc: a Slurm-native serving plane for open LLMs."""

__version__ = "0.1.0"
