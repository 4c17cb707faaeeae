"""The daemon as a program: ``loaderd`` commands, the wiring, signals, the shutdown protocol.

``daemon.Daemon`` constructs every part with its dependencies and owns their order of
start and stop; ``cli`` parses the command line; ``check`` and ``bench`` are the
``loaderd check``/``loaderd bench`` commands. The only daemon package that may import
client packages (``status`` and ``bench`` are clients of a daemon); may import every
other ``loaderd.server`` package.
"""
