"""The parts of :mod:`ec_cache.vllm`, the vLLM connector
(:class:`ec_cache.vllm.ECCacheConnector`, a facade that builds the object of its
role), one concept each.

The roles, each built only in its process, imported by :mod:`ec_cache.vllm` only
(they use ``messages``):

* ``scheduler``: existence answers, the plan of prefetches, the step's metadata;
* ``worker``: prefetches, loads into ``encoder_cache``, background uploads.

Without a vLLM import, so that they can be used and tested without vLLM:

* ``config``: ``ec_connector_extra_config`` parsed, the namespace it resolves to, and
  the clients it makes;
* ``keys``: the ``{hash}`` of an item vLLM names, and the names never cached;
* ``shapes``: the rows and width vLLM expects of an entry;
* ``ttl_cache``: the bounded, expiring answers (cachetools behind a lock);
* ``breaker``: the circuit breaker in front of the scheduler's questions;
* ``counters``: the counters behind vLLM's stats and the log lines;
* ``logs``: the logger, warnings said once, the periodic line of totals;
* ``existence``: the scheduler's "is it in ec-cache?", asked in the background;
* ``planner``: the scheduler's plan of prefetches (asynchronous loads);
* ``prefetch``: the workers' prefetches into host memory, and retried fetches;
* ``uploader``: the bounded background upload queue of ``save_caches``.

Subclasses of vLLM's classes, imported by :mod:`ec_cache.vllm` and the roles only:

* ``messages``: the scheduler's metadata for the workers and their reports back;
* ``stats``: the per-interval stats vLLM aggregates and logs;
* ``metrics``: the Prometheus metrics vLLM exports from those stats.
"""
