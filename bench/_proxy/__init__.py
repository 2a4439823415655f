"""The parts of bench/proxy.py (the entry: its command line and its run): the contenders, the
targets and the run's parameters (params), starting the backend and the contenders with their
configs (launch), the workloads and the interleaved rounds (measure), and the figures turned
into the table, the targets and the JSON (table).
"""
