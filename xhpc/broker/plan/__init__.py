"""Pure planning: replicas' plans and placement, PD units, scaling, replans, desired state,
continuity, queue estimates, pilots' packing.
"""
