"""Support code for :mod:`ec_cache.vllm` that does not import vLLM.

Kept apart so that the configuration model, the bounded caches, the circuit breaker,
the counters, the background uploader, the scheduler's existence answers
(``existence``) and prefetch plan (``planner``) and the workers' prefetcher
(``prefetch``) can be used and tested without vLLM installed. The public connector is
:class:`ec_cache.vllm.ECCacheConnector`.
"""

from ec_cache._vllm.state import CircuitBreaker, Counters, TTLCache, cache_key
from ec_cache._vllm.uploader import BackgroundUploader, UploadJob

__all__ = [
    "BackgroundUploader",
    "CircuitBreaker",
    "Counters",
    "TTLCache",
    "UploadJob",
    "cache_key",
]
