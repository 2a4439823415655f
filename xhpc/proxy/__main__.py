"""`python -m xhpc.proxy ...`: one worker of `xhpc proxy --workers N` (see
xhpc.proxy.process.worker)."""

from xhpc.proxy.process.worker import main

main()
