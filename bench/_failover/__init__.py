"""The parts of bench/failover.py (the entry: its command line and its run): the targets and
the table from the recorded figures (figures).
"""
