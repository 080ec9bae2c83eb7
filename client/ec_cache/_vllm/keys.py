"""The ``{hash}`` under which the connector stores an item vLLM names, and the names
that say nothing of an item's content (no vLLM import)."""

from __future__ import annotations

import hashlib
import re

from ec_cache._keys import hash_error

__all__ = ["cache_key", "request_scoped"]


#: How vLLM (0.32, 0.33: ``vllm/renderers/base.py``) names an item it did not hash: with
#: both its multimodal processor cache (``--mm-processor-cache-gb 0``) and prefix caching
#: off, an item without a user-supplied ``multi_modal_uuids`` value is named after its
#: request's place in the server's count, ``renderer{rank}-mm-{n}-{modality}-{i}``. Such
#: a name says nothing of the content, and every fresh server counts from 1 again.
_REQUEST_SCOPED = re.compile(r"renderer\d+-mm-\d+-\w+-\d+")


def request_scoped(identifier: str) -> bool:
    """Whether ``identifier`` names a request's item rather than its content: never
    looked up or saved (another server's item of that name is another image)."""
    return _REQUEST_SCOPED.fullmatch(identifier) is not None


def cache_key(identifier: str) -> str:
    """The ``{hash}`` segment under which vLLM's multimodal ``identifier`` is stored.

    vLLM's own ids (64/128 hex chars, ``"{lora_name}:{hash}"``) and most user UUIDs are
    valid on the wire and used as they are, so ``curl`` and the
    CLI see the same key vLLM logs. Anything else (a LoRA name with ``/`` or spaces, a
    user id longer than 256 chars, non-ASCII) becomes ``"sha256:" + hexdigest(id)``:
    deterministic, so every worker maps it to the same entry.
    """
    if hash_error(identifier) is None:
        return identifier
    return "sha256:" + hashlib.sha256(identifier.encode("utf-8")).hexdigest()
