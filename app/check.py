"""``python -m app --check``: would a server with these settings start and work? As
``nginx -t``: validate the settings, the data directory and S3 reachability, say what
was found in one line each, and exit 0 when everything is usable, else 1."""

from __future__ import annotations

import asyncio
import tempfile

from app.main import ECApp
from app.settings import Settings
from app.tiers.base import BackendAdmin
from app.tiers.disk.data_dir import DataDirError


def run_checks(settings: Settings, app: ECApp) -> int:
    """Check what ``create_app`` cannot (it touches nothing); the exit status. The data
    directory is claimed as a start-up would claim it (a running server's is in use)."""
    ok = True
    disk = app.state.store.disk
    try:
        disk.claim()
        with tempfile.TemporaryFile(dir=disk.root):
            pass
        print(f"data directory {disk.root.resolve()}: ok")
    except DataDirError as exc:
        ok = False
        print(f"data directory: {exc}")
    except OSError as exc:
        ok = False
        print(f"data directory {disk.root.resolve()}: not writable ({exc.strerror})")
    finally:
        disk.data_dir.release()
    s3 = app.state.store.s3
    if s3 is None:
        print("S3: not configured (disk only)")
    else:
        state = asyncio.run(_s3_readiness(s3))
        if state == "ok":
            print(f"S3 {settings.s3_endpoint_url} bucket {settings.s3_bucket!r}: ok")
        elif state.startswith("no_bucket") and settings.s3_create_bucket:
            print(f"S3 {settings.s3_endpoint_url}: {state} (EC_S3_CREATE_BUCKET creates it)")
        else:
            ok = False
            print(f"S3 {settings.s3_endpoint_url}: {state}")
    print("configuration ok" if ok else "configuration NOT ok")
    return 0 if ok else 1


async def _s3_readiness(s3: BackendAdmin) -> str:
    try:
        return await s3.readiness()
    finally:
        await s3.stop()
