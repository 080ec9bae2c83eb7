"""The layering of issue #14, checked on the source: the S3 backend knows nothing of the
disk, every metric is defined in app/metrics.py, S3 settings live only in Settings."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}


def modules() -> list[Path]:
    return sorted(APP.rglob("*.py"))


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_s3_backend_does_not_know_the_disk() -> None:
    for path in sorted((APP / "tiers" / "s3").glob("*.py")):
        for name in imported(path):
            assert not name.startswith(
                (
                    "app.tiers.disk",
                    "app.tiers.read_through",
                    "app.tiers.upload_",
                    "app.write_policy",
                    "app.store",
                )
            ), f"{path.name} imports {name}"


def test_s3_backend_loads_without_the_disk_side() -> None:
    code = (
        "import sys, app.tiers.s3\n"
        "loaded = [m for m in sys.modules if m.startswith(('app.tiers.disk', "
        "'app.tiers.read_through', 'app.tiers.upload_', 'app.write_policy', 'app.store'))]\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=APP.parent)


def test_read_through_speaks_the_backend_interface_only() -> None:
    names = imported(APP / "tiers" / "read_through.py")
    assert not any(name.startswith("app.tiers.s3") for name in names), names


def test_every_metric_is_defined_in_app_metrics() -> None:
    for path in modules():
        if path == APP / "metrics.py":
            continue
        for name in imported(path):
            module, _, symbol = name.rpartition(".")
            assert not (module.startswith("prometheus_client") and symbol in METRIC_TYPES), (
                f"{path.relative_to(APP)} defines metrics ({symbol}): put them in app/metrics.py"
            )


def test_settings_are_declared_once() -> None:
    for path in modules():
        if path == APP / "settings.py":
            continue
        text = path.read_text()
        assert "BaseSettings" not in text, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert not node.name.endswith("Config"), f"{path.name} declares {node.name}"


def test_error_json_is_built_in_error_responses_only() -> None:
    """Every error body comes from ``app.error_responses.error_document``: no other
    module writes a dict with an ``"error"`` key (``app.openapi`` describes the body)."""
    for path in modules():
        if path in (APP / "error_responses.py", APP / "openapi.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
                assert "error" not in keys, (
                    f"{path.relative_to(APP)}:{node.lineno} builds error JSON"
                )


ROUTES = ("api.py", "entries.py", "namespaces_api.py")
STORE_PARTS = {"disk", "s3", "read_through", "uploads", "purges"}


def test_routes_reach_the_tiers_only_through_the_store() -> None:
    """No route module imports a tier, nor reaches into the store's parts."""
    for name in ROUTES:
        path = APP / name
        tiers = [n for n in imported(path) if n.startswith(("app.tiers", "app.namespaces."))]
        assert not tiers, f"{name} imports {tiers}"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in STORE_PARTS:
                owner = ast.unparse(node.value)
                assert not owner.endswith("store"), f"{name}:{node.lineno} uses {owner}.{node.attr}"
