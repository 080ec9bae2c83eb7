"""The blocking SDK is generated from the asyncio one and must be current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "client" / "ec_cache"


def test_generated_sync_code_is_current() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "unasync.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_generated_files_say_so_and_are_the_only_pairs() -> None:
    sources = {p.name for p in (PACKAGE / "_async").glob("*.py")}
    generated = {p.name for p in (PACKAGE / "_sync").glob("*.py")}
    assert sources == generated and "client.py" in sources and "transport.py" in sources
    for name in generated:
        first = (PACKAGE / "_sync" / name).read_text().splitlines()[0]
        assert first.startswith(f"# Generated from ec_cache/_async/{name} by scripts/unasync.py")
    # no hand-kept twin left beside them
    names = {p.stem for p in PACKAGE.glob("*.py")}
    assert not {n for n in names if n.startswith("_async_") and n[7:] in names | {"_" + n[7:]}}
    assert not (PACKAGE / "_async_client.py").exists()
    assert not (PACKAGE / "_async_transport.py").exists()
