"""`xhpc top`'s pure side: the broker's overview as one typed value (``overview``), the proxy's
metrics parsed and turned into rates (``traffic``), and the frames drawn from both (``view``).

Nothing here does I/O: the broker builds an ``Overview`` (``GET /v1/overview``), the CLI
scrapes the proxy and draws frames (xhpc/cli/observe/top.py).
"""
