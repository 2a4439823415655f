"""The gateway's processes and sockets: the supervisor and its workers, serving and shutting down,
the client-facing listener, TLS, the workers' metric files.
"""
