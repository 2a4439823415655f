"""Remote use over SSH (paramiko): `xhpc --remote USER@HOST ...` runs xhpc on the login node,
`xhpc tunnel` forwards a local port to the lab's proxy. An adapter: the only importer of
paramiko (a library, not a subprocess: nothing here starts a process).

    argv.py     the connection's options, the destination, the quoted remote command line (pure)
    session.py  connect (host keys, agent and key files), run one command, stream its output
    tunnel.py   a local port forwarded through the connection
"""
