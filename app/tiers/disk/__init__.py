"""The disk tier: a bytes-bounded LRU of committed safetensors files under one
directory, in small modules:

* ``tier``: :class:`DiskTier`, reads, writes, space, pins, namespace listing and purge
  (the file layout and its guarantees are in its docstring);
* ``lru``: the in-memory index of entries, least recently used first;
* ``namespaces``: the entries of each namespace (model, dtype), and their bytes;
* ``keys_log``: ``keys.log``, the key of each entry (file names are digests);
* ``pending``: :class:`PendingWrite`, an upload's or a fill's temp file;
* ``group_commit``: the thread that makes finished writes durable and publishes them,
  a batch at a time;
* ``file_sync``: ``fsync_dir`` and ``start_writeback`` (``sync_file_range`` via ctypes).
"""

from app.tiers.disk.group_commit import StagedFile
from app.tiers.disk.namespaces import NamespaceUsage
from app.tiers.disk.pending import PendingWrite
from app.tiers.disk.tier import DiskStats, DiskTier, OpenedEntry

__all__ = ["DiskStats", "DiskTier", "NamespaceUsage", "OpenedEntry", "PendingWrite", "StagedFile"]
