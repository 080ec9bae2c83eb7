"""The E/PD split as vLLM's disaggregated-encoder examples run it, with ec-cache between.

An ``ec_producer`` instance (encoder only: ``--mm-encoder-only``) is sent each request
with ``max_tokens=1`` and fills the cache; an ``ec_consumer`` instance then answers the
original request without running its encoder. Both are vLLM's OpenAI-compatible server.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from testkit.server import ServerProcess
from testkit.vllm_engine import ROOT, connector_config, vllm_server
from testkit.vllm_engine.engine_run import image
from tests.vllm_engine.conftest import PROMPTS, UNIQUE_IMAGES, count, request_counts

# sitecustomize: the encoder probe, in the API server's engine core process too
PROBE_SITE = ROOT / "testkit" / "vllm_engine" / "probe_site"


@contextmanager
def api_server(
    python: Path, model: Path, work: Path, ec_transfer_config: dict[str, Any], *args: str
) -> Iterator[tuple[str, Path]]:
    """A vLLM API server with the encoder probe; yields its URL and the probe's log."""
    work.mkdir(parents=True)
    probe_log = work / "encoder.log"
    probe_log.touch()
    probe = {
        "EC_TEST_ENCODER_LOG": str(probe_log),
        "PYTHONPATH": f"{PROBE_SITE}{os.pathsep}{ROOT}",
    }
    with vllm_server(
        model, work / "server", "--max-model-len", "512", "--max-num-seqs", "8",
        "--limit-mm-per-prompt", '{"image": 4}',
        "--ec-transfer-config", json.dumps(ec_transfer_config), *args,
        python=python, env_extra=probe, timeout=300,
    ) as url:  # fmt: skip
        yield url, probe_log


def chat_request(prompt: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for seed in prompt["images"]:
        png = io.BytesIO()
        image(seed).save(png, format="PNG")  # lossless: the pixels engine_run uses
        data = base64.b64encode(png.getvalue()).decode()
        content.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
    content.append({"type": "text", "text": prompt["text"]})
    return {
        "model": "ignored",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }


def chat(url: str, model: Path, prompt: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    body = {**chat_request(prompt, max_tokens), "model": str(model)}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    steps = response.json()["choices"][0]["logprobs"]["content"]
    return {
        "token_ids": [int(step["token"].removeprefix("token_id:")) for step in steps],
        "logprobs": [step["logprob"] for step in steps],
    }


def encoded_rows(probe_log: Path) -> int:
    return sum(int(line) for line in probe_log.read_text().split())


def test_producer_fills_consumer_answers_without_its_encoder(
    engine_python: Path,
    tiny_model: Path,
    baseline: dict[str, Any],
    ec_server: ServerProcess,
    tmp_path: Path,
) -> None:
    producer_config = connector_config(ec_server.url, ec_role="ec_producer")
    consumer_config = connector_config(ec_server.url, ec_role="ec_consumer")
    with api_server(
        engine_python, tiny_model, tmp_path / "producer", producer_config, "--mm-encoder-only"
    ) as (producer, producer_probe):
        rows_at_start = encoded_rows(producer_probe)  # start-up profiling, if any
        for prompt in PROMPTS:
            body = {**chat_request(prompt, 1), "model": str(tiny_model)}
            response = httpx.post(f"{producer}/v1/chat/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
        assert encoded_rows(producer_probe) - rows_at_start == baseline["encoder_rows"]
    # The producer shut down cleanly, so its queued uploads are done.
    filled = request_counts(ec_server.url)
    assert filled.get(("entry", "PUT", "201")) == UNIQUE_IMAGES

    with api_server(engine_python, tiny_model, tmp_path / "consumer", consumer_config) as (
        consumer,
        consumer_probe,
    ):
        rows_at_start = encoded_rows(consumer_probe)
        outputs = [chat(consumer, tiny_model, prompt, 8) for prompt in PROMPTS]
        assert encoded_rows(consumer_probe) == rows_at_start  # the encoder never ran
    for i, (got, want) in enumerate(zip(outputs, baseline["outputs"], strict=True)):
        assert got["token_ids"] == want["token_ids"], f"prompt {i}: tokens differ"
        assert got["logprobs"] == want["logprobs"], f"prompt {i}: logprobs differ"
    counts = request_counts(ec_server.url)
    assert count(counts, "entry", "GET") == UNIQUE_IMAGES
    assert count(counts, "entry", "PUT") == UNIQUE_IMAGES  # the consumer uploads nothing
