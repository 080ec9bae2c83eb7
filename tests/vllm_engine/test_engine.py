"""The connector inside a real vLLM engine: miss, then hit in a fresh engine."""

from __future__ import annotations

from typing import Any

from testkit.server import ServerProcess
from testkit.vllm_engine import connector_config
from tests.vllm_engine.conftest import (
    UNIQUE_IMAGES,
    EngineRun,
    assert_same_outputs,
    count,
    request_counts,
)


def test_miss_then_hit_in_a_fresh_engine_then_negative_control(
    run_engine: EngineRun, baseline: dict[str, Any], ec_server: ServerProcess
) -> None:
    config = connector_config(ec_server.url)

    miss = run_engine(config)
    assert miss["encoder_calls"] > 0
    assert miss["encoder_rows"] == baseline["encoder_rows"]
    assert_same_outputs(miss, baseline)
    after_miss = request_counts(ec_server.url)
    # One upload per distinct image: the image shared by two requests of the batch and
    # the image given twice in one request are each stored once.
    assert count(after_miss, "entry", "PUT") == UNIQUE_IMAGES
    assert after_miss.get(("entry", "PUT", "201")) == UNIQUE_IMAGES

    hit = run_engine(config)
    # Measured, not trusted: vLLM's vision transformer never ran in this engine.
    assert hit["encoder_calls"] == 0
    assert hit["encoder_rows"] == 0
    assert_same_outputs(hit, baseline)
    after_hit = request_counts(ec_server.url)
    assert count(after_hit, "entry", "GET") - count(after_miss, "entry", "GET") == UNIQUE_IMAGES
    assert after_hit.get(("entry", "GET", "200"), 0) == UNIQUE_IMAGES
    assert count(after_hit, "entry", "PUT") == UNIQUE_IMAGES  # nothing uploaded again

    # Negative control: the comparison above can fail. The same hit with every loaded
    # tensor nudged by 1e-2 (in the engine, after the load) changes the logprobs.
    nudged = run_engine(config, perturb_loads=True)
    assert nudged["encoder_calls"] == 0
    assert [o["logprobs"] for o in nudged["outputs"]] != [
        o["logprobs"] for o in baseline["outputs"]
    ]
