"""The connector's ``ec_connector_extra_config`` model (no vLLM needed to parse it)."""

from __future__ import annotations

import pytest
from ec_cache._vllm.config import ECCacheConnectorConfig
from ec_cache._vllm.config import parse_size as connector_parse_size

from app.settings import parse_size as server_parse_size

# One size grammar for server settings and connector config.
SIZES = {
    "1": 1,
    "4096": 4096,
    "512K": 512 << 10,
    "512KB": 512 << 10,
    "512KiB": 512 << 10,
    "512M": 512 << 20,
    "512MB": 512 << 20,
    "512mib": 512 << 20,
    " 10 GiB ": 10 << 30,
    "2T": 2 << 40,
    "7B": 7,
}
NOT_SIZES = ["", "lots", "1.5GiB", "-1", "+5", "512 MiB extra", "0x10", "1_0", "5PB", "\u0665M"]


@pytest.mark.parametrize("parse", [server_parse_size, connector_parse_size])
@pytest.mark.parametrize(("text", "size"), sorted(SIZES.items()))
def test_size_grammar_is_the_servers(parse: object, text: str, size: int) -> None:
    assert parse(text) == size  # type: ignore[operator]


@pytest.mark.parametrize("parse", [server_parse_size, connector_parse_size])
@pytest.mark.parametrize("text", NOT_SIZES)
def test_size_grammar_refuses_the_same(parse: object, text: str) -> None:
    with pytest.raises(ValueError):
        parse(text)  # type: ignore[operator]


def test_typed_values_from_strings_and_json() -> None:
    cfg = ECCacheConnectorConfig.from_extra_config(
        {
            "url": "http://a:8080, http://b:8080",
            "save_queue_bytes": "512M",
            "save": "false",
            "hit_ttl_s": None,
            "exists_timeout_s": "0.05",
            "load_concurrency": 4.0,
            "model": "",
        }
    )
    assert cfg.urls == ("http://a:8080", "http://b:8080")
    assert cfg.save_queue_bytes == 512 << 20
    assert cfg.save is False and cfg.hit_ttl_s is None and cfg.exists_timeout_s == 0.05
    assert cfg.load_concurrency == 4 and cfg.model is None
    assert ECCacheConnectorConfig.from_extra_config({"urls": ["http://a"]}).urls == ("http://a",)


def test_asynchronous_load_settings() -> None:
    default = ECCacheConnectorConfig.from_extra_config({"url": "http://a"})
    assert default.load_mode == "async" and default.exists_wait_s == 0.002
    assert default.prefetch_buffer_bytes == 1 << 30
    cfg = ECCacheConnectorConfig.from_extra_config(
        {"url": "http://a", "load_mode": "sync", "prefetch_buffer_bytes": "256MiB",
         "exists_wait_s": "0"}
    )  # fmt: skip
    assert cfg.load_mode == "sync" and cfg.exists_wait_s == 0
    assert cfg.prefetch_buffer_bytes == 256 << 20


def test_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EC_CACHE_URL", "http://env:8080")
    monkeypatch.setenv("EC_CACHE_TOKEN", "secret")
    cfg = ECCacheConnectorConfig.from_extra_config({})
    assert cfg.urls == ("http://env:8080",) and cfg.token == "secret"


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        ({"url": "http://a", "on_load_failure": "ignore"}, "on_load_failure"),
        ({"url": "http://a", "save_queue_bytes": "lots"}, "save_queue_bytes"),
        ({"url": "http://a", "save_queue_bytes": 0}, "save_queue_bytes"),
        ({"url": "http://a", "breaker_failures": 0}, "breaker_failures"),
        ({"url": "http://a", "load_concurrency": 2.5}, "load_concurrency"),
        ({"url": "http://a", "encoder_revision": "a/b"}, "encoder_revision"),
        ({"url": "http://a", "save": "maybe"}, "save"),
        ({"url": "http://a", "exists_timeout_s": 0}, "exists_timeout_s"),
        ({"url": "http://a", "exists_wait_s": -1}, "exists_wait_s"),
        ({"url": "http://a", "load_mode": "lazy"}, "load_mode"),
        ({"url": "http://a", "prefetch_buffer_bytes": "0"}, "prefetch_buffer_bytes"),
        ({"url": "http://a", "exist_timeout_s": 1}, "unknown key"),
        ({"url": "http://a", "urls": ["http://b"]}, "not both"),
        ({"url": " , "}, "urls"),
    ],
)
def test_bad_values_name_their_key(bad: dict[str, object], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        ECCacheConnectorConfig.from_extra_config(bad)


def test_no_server_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EC_CACHE_URL", raising=False)
    with pytest.raises(ValueError, match="needs the server"):
        ECCacheConnectorConfig.from_extra_config({})


def test_frozen() -> None:
    cfg = ECCacheConnectorConfig.from_extra_config({"url": "http://a"})
    with pytest.raises(ValueError):
        cfg.load_timeout_s = 1.0  # type: ignore[misc]
