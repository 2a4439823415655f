"""Slurm: argv building and parsing (pure, argv.py and parse.py) and the client backends
(adapter, client.py)."""
