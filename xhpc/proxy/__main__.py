"""`python -m xhpc.proxy ...`: one worker of `xhpc proxy --workers N` (see xhpc.proxy.worker)."""

from xhpc.proxy.worker import main

main()
