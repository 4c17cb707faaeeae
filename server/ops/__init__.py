"""What operators see: the status snapshot, Prometheus metrics, systemd's sd_notify.

Reads the other parts through their snapshots; may import every daemon package below
``app``.
"""
