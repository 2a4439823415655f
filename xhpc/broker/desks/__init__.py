"""The broker service's desks, each owning one responsibility and its state: agents, the weights
cache and pulls, pilots, PD units and their front, usage, sweeps, orphans, the proxies' routes,
lost jobs, replans and the launcher.
"""
