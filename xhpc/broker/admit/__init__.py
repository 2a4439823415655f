"""Who may do what, and what a request may be: admission, authorization, the site's job policy,
members' jobs, job shapes, tags, key identities.
"""
