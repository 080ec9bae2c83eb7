"""The parts of :mod:`ec_cache.vllm`, the vLLM connector
(:class:`ec_cache.vllm.ECCacheConnector`), one concept each.

Without a vLLM import, so that they can be used and tested without vLLM:

* ``config``: ``ec_connector_extra_config`` parsed, and the namespace it resolves to;
* ``keys``: the ``{hash}`` of an item vLLM names, and the names never cached;
* ``ttl_cache``: the bounded, expiring answers (cachetools behind a lock);
* ``breaker``: the circuit breaker in front of the scheduler's questions;
* ``counters``: the counters behind vLLM's stats and the log lines;
* ``existence``: the scheduler's "is it in ec-cache?", asked in the background;
* ``planner``: the scheduler's plan of prefetches (asynchronous loads);
* ``prefetch``: the workers' prefetches into host memory, and retried fetches;
* ``uploader``: the bounded background upload queue of ``save_caches``.

Subclasses of vLLM's classes, imported by :mod:`ec_cache.vllm` only:

* ``messages``: the scheduler's metadata for the workers and their reports back;
* ``stats``: the per-interval stats vLLM aggregates and logs;
* ``metrics``: the Prometheus metrics vLLM exports from those stats.
"""
