"""Slurm: argv building and parsing (pure) and the client backends (adapters)."""

from xhpc.slurm.client import CliSlurmClient, SlurmClient

__all__ = ["CliSlurmClient", "SlurmClient"]
