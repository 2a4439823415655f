"""The parts of bench/routing.py (the entry: its command line and its run): the policies, the
paths and the run's parameters (params), the seeded multi-turn workload (workload), the vLLM
engines: started, sized, inspected (engines), the measurement through xhpc's own gateway in
this process (measure), and the figures turned into the table, the target and the JSON (table).
"""
