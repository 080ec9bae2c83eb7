"""Storage tiers behind one narrow interface (see ``base``).

* ``base``: what the store hands out (an entry's description and body) and the
  :class:`base.Backend` interface;
* ``disk``: the bounded local LRU (always present), a package;
* ``overlapped``: a disk write fed from the event loop while the file system works;
* ``read_through``: disk misses filled from a backend, single-flight;
* ``write_through``: a write-through PUT's upload overlapping its receive;
* ``upload_journal``: the write-back journal (what each key owes S3, on disk);
* ``upload_scheduler``: the write-back uploads and deletes, retried, and deleted keys hidden;
* ``s3``: the S3 backend (a :class:`base.Backend`; knows nothing of the disk), a package.
"""
