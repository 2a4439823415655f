"""The parts of bench/hostile.py (the entry: its command line and its run): the paced chat and
health traffic whose latency is measured and its percentiles (measure), the two hostile tenants,
a child process of their own (tenants), and the round figures turned into the table, the targets
and the JSON (table). Only table and measure's percentiles are pure; the rest needs a broker and
a gateway on the dev cluster.
"""
