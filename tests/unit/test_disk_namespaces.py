"""The disk tier's namespaces: usage, listing, purge, keys.log across restarts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.checksum import crc32c
from app.keys import EntryKey
from app.safetensors_format import validate_body
from app.tiers.disk import DiskTier, NamespaceUsage
from app.tiers.disk import keys_log as keys_log_module
from testkit.entries import body


def _put(tier: DiskTier, model: str, dtype: str, hash_: str, n: int = 8) -> int:
    code, size = {"uint8": ("U8", 1), "float16": ("F16", 2)}[dtype]
    data = body((n,), code, size, seed=len(hash_))
    pending = tier.begin_write(EntryKey.parse(model, dtype, hash_), len(data))
    try:
        pending.write([data])
        assert pending.commit(crc32c(data), validate_body(data, dtype))
    finally:
        pending.abort()
    return len(data)


def _usage(tier: DiskTier) -> dict[tuple[str | None, str | None], tuple[int, int]]:
    usage, unattributed = tier.namespaces()
    found = {(u.model, u.dtype): (u.entries, u.bytes) for u in usage}
    if unattributed.entries:
        found[None, None] = (unattributed.entries, unattributed.bytes)
    return found


def test_usage_listing_and_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1_000_000)
    tier.rebuild()
    a = [_put(tier, "Qwen/A", "uint8", f"h{i:02d}") for i in range(5)]
    b = _put(tier, "Qwen/A", "float16", "x", 4)
    c = _put(tier, "llava", "uint8", "y")
    want = {
        ("Qwen/A", "uint8"): (5, sum(a)),
        ("Qwen/A", "float16"): (1, b),
        ("llava", "uint8"): (1, c),
    }
    assert _usage(tier) == want
    page, cursor = tier.list_namespace("Qwen/A", "uint8", None, 2)
    assert [e.hash for e in page] == ["h00", "h01"]
    assert cursor == "h01"
    page, cursor = tier.list_namespace("Qwen/A", "uint8", cursor, 10)
    assert [e.hash for e in page] == ["h02", "h03", "h04"]
    assert cursor is None
    assert page[0].header is not None and page[0].header.shape == (8,)

    again = DiskTier(tmp_path, 1_000_000)
    again.rebuild()  # keys come back from keys.log; shapes from the files
    assert _usage(again) == want
    page, _ = again.list_namespace("Qwen/A", "float16", None, 10)
    assert page[0].header is not None and page[0].header.shape == (4,)


def test_delete_and_eviction_keep_counts_right(tmp_path: Path) -> None:
    size = len(body((8,), "U8", 1))
    tier = DiskTier(tmp_path, 3 * size)
    tier.rebuild()
    for i in range(5):
        _put(tier, "m", "uint8", f"k{i}")
    assert _usage(tier) == {("m", "uint8"): (3, 3 * size)}
    assert tier.delete(EntryKey.parse("m", "uint8", "k4"))
    assert _usage(tier) == {("m", "uint8"): (2, 2 * size)}
    page, _ = tier.list_namespace("m", "uint8", None, 10)
    assert [e.hash for e in page] == ["k2", "k3"]


def test_purge_one_dtype_all_dtypes_and_unattributed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1_000_000)
    tier.rebuild()
    for i in range(3):
        _put(tier, "old", "uint8", f"u{i}")
        _put(tier, "old", "float16", f"f{i}")
        _put(tier, "old/sub", "uint8", f"s{i}")
    assert tier.purge("old", "uint8")[0] == 3
    assert set(_usage(tier)) == {("old", "float16"), ("old/sub", "uint8")}
    assert tier.purge("old", "uint8") == (0, 0)  # idempotent
    assert tier.purge("old", None)[0] == 3
    assert set(_usage(tier)) == {("old/sub", "uint8")}  # another model, untouched

    (tmp_path / "keys.log").unlink()  # as after an upgrade: keys unknown
    again = DiskTier(tmp_path, 1_000_000)
    again.rebuild()
    assert _usage(again) == {(None, None): (3, again.stats().used_bytes)}
    assert again.purge("anything", None)[0] == 3  # unattributed entries go with any purge
    assert again.stats().entries == 0
    assert list((tmp_path / "objects").rglob("*.safetensors")) == []


def test_keys_log_is_compacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys_log_module, "KEYS_LOG_SLACK", 4)
    size = len(body((8,), "U8", 1))
    tier = DiskTier(tmp_path, 2 * size)
    tier.rebuild()
    for i in range(40):
        _put(tier, "m", "uint8", f"k{i:02d}")
        # every entry present has its line (a compaction a commit triggers keeps the
        # line of that commit: else the entry is unattributed after a restart)
        logged = {line.split(" ")[0] for line in (tmp_path / "keys.log").read_text().splitlines()}
        present = {p.name.split(".")[0] for p in (tmp_path / "objects").rglob("*.safetensors")}
        assert present <= logged, i
    lines = (tmp_path / "keys.log").read_text().splitlines()
    assert len(lines) <= 2 * 2 + 4 + 1
    again = DiskTier(tmp_path, 2 * size)
    again.rebuild()
    assert again.namespaces()[0] == [NamespaceUsage("m", "uint8", 2, 2 * size)]


def test_torn_or_forged_lines_are_ignored(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1_000_000)
    tier.rebuild()
    _put(tier, "m", "uint8", "good")
    _put(tier, "m", "uint8", "other")
    log = tmp_path / "keys.log"
    good, other = log.read_text().splitlines()
    digest = other.split(" ")[0]
    log.write_text(f"{good}\n{digest} evil uint8 other\n{digest[:10]}")
    again = DiskTier(tmp_path, 1_000_000)
    again.rebuild()
    assert _usage(again)[("m", "uint8")][0] == 1
    assert _usage(again)[None, None][0] == 1


def test_contains_hashes_by_namespace_and_for_unattributed_entries(tmp_path: Path) -> None:
    size = len(body((8,), "U8", 1))
    tier = DiskTier(tmp_path, 4 * size)
    tier.rebuild()
    for i in range(3):
        _put(tier, "m", "uint8", f"k{i}")
    _put(tier, "other", "uint8", "k3")
    asked = ["k0", "k3", "k1", "absent", "k2", "k0"]
    assert tier.contains_hashes("m", "uint8", asked) == [True, False, True, False, True, True]
    assert tier.contains_hashes("m", "float16", ["k0"]) == [False]  # another dtype
    assert tier.contains_hashes("m", "uint8", []) == []

    assert tier.delete(EntryKey.parse("m", "uint8", "k1"))
    _put(tier, "m", "uint8", "k4")
    _put(tier, "m", "uint8", "k5")  # the bound is 4 entries: k0 (least recent) goes
    assert tier.contains_hashes("m", "uint8", ["k0", "k1", "k2", "k4", "k5"]) == [
        False,
        False,
        True,
        True,
        True,
    ]

    (tmp_path / "keys.log").unlink()  # keys unknown after a restart: found by digest
    again = DiskTier(tmp_path, 5 * size)  # room for one more: nothing is evicted
    again.rebuild()
    assert _usage(again) == {(None, None): (4, 4 * size)}
    assert again.contains_hashes("m", "uint8", ["k2", "k0", "k5", "k3"]) == [
        True,
        False,
        True,
        False,
    ]
    assert again.contains_hashes("other", "uint8", ["k3"]) == [True]
    _put(again, "m", "uint8", "k6")  # attributed beside unattributed ones
    assert again.contains_hashes("m", "uint8", ["k6", "k4", "k9"]) == [True, True, False]


@pytest.mark.parametrize("replacement", ["directory", "fifo"])
def test_a_keys_log_that_is_not_a_file_is_set_aside_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, replacement: str
) -> None:
    """keys.log replaced by a directory (or a FIFO, which would block a read): start-up
    says so, moves it aside and rebuilds the log; the entries stay, unattributed."""
    tier = DiskTier(tmp_path, 1_000_000)
    tier.rebuild()
    size = _put(tier, "m", "uint8", "before")
    tier.close()
    log_path = tmp_path / "keys.log"
    log_path.unlink()
    if replacement == "directory":
        log_path.mkdir()
        (log_path / "inside").write_text("operator's file")
    else:
        os.mkfifo(log_path)

    again = DiskTier(tmp_path, 1_000_000)
    again.rebuild()
    assert "keys.log is not a regular file: moved to" in caplog.text
    (aside,) = tmp_path.glob("keys.log.invalid-*")
    assert aside.is_dir() if replacement == "directory" else aside.is_fifo()
    assert _usage(again) == {(None, None): (1, size)}
    _put(again, "m", "uint8", "after")
    assert log_path.is_file()
    again.close()

    third = DiskTier(tmp_path, 1_000_000)
    third.rebuild()
    assert _usage(third) == {("m", "uint8"): (1, size), (None, None): (1, size)}
