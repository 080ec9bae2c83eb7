"""Tenant-scoped tokens (``model=PATTERN``): every route x scope x namespace match or
mismatch, against a real server process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from app.auth import ModelPattern, parse_tokens
from testkit.entries import body
from testkit.server import ServerProcess

QWEN_RW = "qwen-writer-token-0123456789"
QWEN_ADMIN = "qwen-admin-token-0123456789"
LLAVA_READ = "llava-reader-token-012345678"
OPS = "ops-token-0123456789abcdef"
TOKENS = "\n".join(
    [
        f"qwen-writer:read,write,model=Qwen/*:{QWEN_RW}",
        f"qwen-ops:admin,model=Qwen/**:{QWEN_ADMIN}",
        f"llava:read, model=llava-hf/* , model=liuhaotian/*:{LLAVA_READ}",
        f"ops:admin:{OPS}  # an old line: every namespace",
    ]
)
TOKEN = {"qwen-writer": QWEN_RW, "qwen-ops": QWEN_ADMIN, "llava": LLAVA_READ, "ops": OPS}
SCOPES = {
    "qwen-writer": {"read", "write"},
    "qwen-ops": {"read", "write", "admin"},
    "llava": {"read"},
    "ops": {"read", "write", "admin"},
}
# model -> the tokens whose patterns match it
MODELS = {
    "Qwen/Qwen2-VL-7B": {"qwen-writer", "qwen-ops", "ops"},
    "Qwen/Qwen2-VL-7B@a1b2c3": {"qwen-writer", "qwen-ops", "ops"},
    "Qwen/deep/er": {"qwen-ops", "ops"},  # `*` stays in one segment, `**` does not
    "Qwen": {"ops"},
    "QwenEvil/Qwen2-VL-7B": {"ops"},
    "llava-hf/llava-1.5-7b-hf": {"llava", "ops"},
}

Call = Callable[[str, str, str], httpx.Response]  # (base url, model, token)


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _entry(url: str, model: str) -> str:
    return f"{url}/ec/{model}/uint8/tenant"


ROUTES: dict[str, tuple[str, Call]] = {
    "GET": ("read", lambda u, m, t: httpx.get(_entry(u, m), headers=_h(t))),
    "HEAD": ("read", lambda u, m, t: httpx.head(_entry(u, m), headers=_h(t))),
    "PUT": (
        "write",
        lambda u, m, t: httpx.put(_entry(u, m), content=body((8,), "U8", 1), headers=_h(t)),
    ),
    "DELETE": ("admin", lambda u, m, t: httpx.delete(_entry(u, m), headers=_h(t))),
    "exists": (
        "read",
        lambda u, m, t: httpx.post(
            f"{u}/ec/{m}/uint8/_exists", json={"hashes": ["tenant"]}, headers=_h(t)
        ),
    ),
    "exists %2F": (
        "read",
        lambda u, m, t: httpx.post(
            f"{u}/ec/{m.replace('/', '%2F')}/uint8/_exists",
            json={"hashes": ["tenant"]},
            headers=_h(t),
        ),
    ),
    "entries": (
        "read",
        lambda u, m, t: httpx.get(
            f"{u}/namespaces/entries", params={"model": m, "dtype": "uint8"}, headers=_h(t)
        ),
    ),
    # int8: a namespace no other route uses, so a purge never races them
    "purge": (
        "admin",
        lambda u, m, t: httpx.post(
            f"{u}/namespaces/purge", json={"model": m, "dtype": "int8"}, headers=_h(t)
        ),
    ),
}


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("tenants")
    with ServerProcess(root / "data", root / "log", auth_tokens=TOKENS) as srv:
        yield srv


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("who", list(TOKEN))
@pytest.mark.parametrize("route", list(ROUTES))
def test_route_scope_namespace(tenants: ServerProcess, route: str, who: str, model: str) -> None:
    scope, call = ROUTES[route]
    response = call(tenants.url, model, TOKEN[who])
    if scope in SCOPES[who] and who in MODELS[model]:
        assert response.status_code in (200, 201, 202, 204, 404), response.text
    else:
        assert response.status_code == 403, response.text
        if route != "HEAD":
            assert response.json()["error"] == "forbidden"


def test_tenant_cannot_plant_under_another_tenants_keys(tenants: ServerProcess) -> None:
    victim = f"{tenants.url}/ec/llava-hf/llava-1.5-7b-hf/uint8/victim-hash"
    forged = body((8,), "U8", 1, seed=7)
    assert httpx.put(victim, content=forged, headers=_h(QWEN_RW)).status_code == 403
    assert httpx.get(victim, headers=_h(LLAVA_READ)).status_code == 404
    real = body((8,), "U8", 1, seed=8)
    assert httpx.put(victim, content=real, headers=_h(OPS)).status_code == 201
    assert httpx.get(victim, headers=_h(LLAVA_READ)).content == real
    assert httpx.get(victim, headers=_h(QWEN_RW)).status_code == 403


def test_server_wide_routes_need_an_unrestricted_token(tenants: ServerProcess) -> None:
    assert httpx.get(tenants.url + "/stats", headers=_h(OPS)).status_code == 200
    response = httpx.get(tenants.url + "/stats", headers=_h(QWEN_RW))
    assert response.status_code == 403
    assert "limited to some models" in response.json()["message"]
    assert httpx.get(tenants.url + "/metrics", headers=_h(QWEN_RW)).status_code == 200  # public


def test_private_metrics_need_an_unrestricted_token(tmp_path: Path) -> None:
    with ServerProcess(
        tmp_path / "d", tmp_path / "log", auth_tokens=TOKENS, metrics_public="false"
    ) as srv:
        assert httpx.get(srv.url + "/metrics", headers=_h(QWEN_RW)).status_code == 403
        assert httpx.get(srv.url + "/metrics", headers=_h(OPS)).status_code == 200


def test_old_token_lines_parse_as_before() -> None:
    (token,) = parse_tokens("reader:read:abcdefghijklmnop:with:colons", "test")
    assert token.name == "reader"
    assert {str(s) for s in token.scopes} == {"read"}
    assert token.models == ()


@pytest.mark.parametrize(
    ("pattern", "model", "matches"),
    [
        ("Qwen/*", "Qwen/Qwen2.5-VL-7B-Instruct", True),
        ("Qwen/*", "Qwen/Qwen2.5-VL-7B-Instruct@a1b2c3", True),
        ("Qwen/*", "Qwen", False),
        ("Qwen/*", "Qwen/a/b", False),
        ("Qwen/**", "Qwen/a/b", True),
        ("Qwen/*", "QwenX/a", False),
        ("Qwen/Qwen2*", "Qwen/Qwen2-VL", True),
        ("exact-model", "exact-model", True),
        ("exact-model", "exact-model2", False),
        ("a.b/*", "aXb/c", False),  # `.` is literal
    ],
)
def test_patterns(pattern: str, model: str, matches: bool) -> None:
    assert ModelPattern.parse(pattern).matches(model) is matches


@pytest.mark.parametrize("bad", ["model=", "model=Qwen/../x", "model=Qw en", "superuser"])
def test_bad_scope_items_name_the_entry_not_the_secret(bad: str) -> None:
    with pytest.raises(ValueError, match=r"entry 1 \(t\)") as info:
        parse_tokens(f"t:read,{bad}:secret-secret-secret", "EC_AUTH_TOKENS")
    assert "secret-secret-secret" not in str(info.value)


def test_listings_show_only_the_tokens_namespaces(tenants: ServerProcess) -> None:
    for model in ("Qwen/list-a", "llava-hf/list-b"):
        data = body((8,), "U8", 1, seed=9)
        response = httpx.put(f"{tenants.url}/ec/{model}/uint8/l", content=data, headers=_h(OPS))
        assert response.status_code == 201
    for who, visible in [("qwen-writer", "Qwen/list-a"), ("llava", "llava-hf/list-b")]:
        listing = httpx.get(tenants.url + "/namespaces", headers=_h(TOKEN[who])).json()
        models = {n["model"] for n in listing["namespaces"]}
        other = ({"Qwen/list-a", "llava-hf/list-b"} - {visible}).pop()
        assert visible in models
        assert other not in models
        assert "unattributed" not in listing  # server-wide figures: unrestricted tokens only
    everything = httpx.get(tenants.url + "/namespaces", headers=_h(OPS)).json()
    assert {"Qwen/list-a", "llava-hf/list-b"} <= {n["model"] for n in everything["namespaces"]}
    assert "unattributed" in everything
    purge = httpx.post(
        tenants.url + "/namespaces/purge",
        json={"model": "Qwen/list-a", "dtype": "int16"},
        headers=_h(QWEN_ADMIN),
    )
    assert purge.status_code in (200, 202)
    llava_view = httpx.get(tenants.url + "/namespaces/purges", headers=_h(LLAVA_READ)).json()
    assert all(
        job["model"].startswith(("llava-hf/", "liuhaotian/")) for job in llava_view["purges"]
    )
    ops_view = httpx.get(tenants.url + "/namespaces/purges", headers=_h(OPS)).json()
    assert "Qwen/list-a" in {job["model"] for job in ops_view["purges"]}
