"""The parts of bench/continuity.py (the entry: its command line and its run): the scenarios'
names, timings and targets (params), the broker's samples turned into figures (figures), the
figures turned into the table, the targets and the JSON (table), what is sampled while a
scenario runs (sampling), the faults themselves (faults) and one scenario from start to
teardown (scenarios). Only figures and table are pure; the rest needs the dev cluster.
"""
