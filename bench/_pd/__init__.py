"""The parts of bench/pd.py (the entry: its command line and its run): the contenders, the
workloads and the run's parameters (params), starting the engines, the stand-in broker and both
proxies (launch), the prompts, the requests and the interleaved rounds (measure), and the
figures turned into the tables and the JSON (table).
"""
