"""Storage tiers behind one narrow interface (see ``base``).

* ``disk``: the bounded local LRU (always present);
* ``read_through``: disk misses filled from a backend, single-flight;
* ``s3``: the S3 backend (a :class:`base.Backend`; knows nothing of the disk);
* ``upload_queue``: the durable write-back queue.
"""
