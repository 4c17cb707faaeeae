"""The item cache: a dataset's items kept once computed, read back by every worker, epoch and daemon.

``item_codec`` lays an item out with loaderd's wire codec (never pickle: a disk cache another
local user could write must not run code when read) and refuses what it would not give back
as it was; ``item_store`` keeps one dataset's encoded items in an LMDB environment (a memory
tier in /dev/shm that the daemon owns, or a disk tier that outlives it), keyed by index, in an
environment named by a fingerprint of the dataset's spec; ``auto`` is ``cache: auto``'s policy.
The workers store and read items; the daemon imports only the torch-free modules (``auto``,
``usage``, ``location``: the policy, status, the store's path). May import
``loaderd.server.config``, ``process`` and the shared layers.
"""
