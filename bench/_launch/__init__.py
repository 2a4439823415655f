"""The parts of the launch benchmarks (bench/launch.py; bench/submit_to_ready.py shares the
cluster helpers): the dev cluster as they see it (cluster), the run's fixed figures (params),
the one vLLM command and set of Slurm resources every contender gets (engine), vec-inf's
configuration and job files (vecinf), the three contenders (contenders), the one poll loop
that times them (measure), and the figures turned into the table and targets (table).
"""
