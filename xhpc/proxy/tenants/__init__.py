"""Who calls and what each may hold: API keys, token quotas and holds, rates, the other workers'
holds, per-client limits and the Files/Batch pace.
"""
