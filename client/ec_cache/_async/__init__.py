"""The SDK's I/O: ``ec_cache._async`` is the source, ``ec_cache._sync`` is generated
from it by ``scripts/unasync.py``."""
