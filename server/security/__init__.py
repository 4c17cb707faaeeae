"""Who may call, on which listener: bearer tokens, mTLS subjects, TLS credentials, listen sockets.

May import ``loaderd.server.config``, ``loaderd.server.process`` and the shared layers.
"""
