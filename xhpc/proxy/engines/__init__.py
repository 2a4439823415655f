"""Reaching engines: the seam (what an HTTP client must do for the gateway, and how it may fail),
the gateway's own HTTP/1.1 client and aiohttp's, an answer's grammar and limits, whether a
replica's job is gone, engines' context lengths.
"""
