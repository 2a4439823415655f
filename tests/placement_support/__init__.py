"""Placement test and benchmark support: the brute-force reference and seeded synthetic clusters.

Imported by tests/unit/test_placement_*.py, test_slurm_parse.py and bench/placement.py (which puts
the repository root on ``sys.path``); nothing in ``xhpc`` imports it.
"""
