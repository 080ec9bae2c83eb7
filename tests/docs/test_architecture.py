"""docs/architecture.md (and the other documents) names only modules that exist, of the
server and of the SDK; it names every module of the SDK; docs/s3.md's file table lists
every module of the S3 backend; every relative link of a document leads to a file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCUMENTS = sorted(
    [
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
        ROOT / "client" / "README.md",
        ROOT / "bench" / "README.md",
        ROOT / "helm" / "ec-cache" / "README.md",
    ]
)
MODULE = re.compile(r"\b(?:app|client)/[\w/]+\.py\b")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
SDK = ROOT / "client" / "ec_cache"


def named_modules(document: Path) -> set[str]:
    return set(MODULE.findall(document.read_text()))


def test_the_architecture_names_the_modules_of_each_layer() -> None:
    named = named_modules(ARCHITECTURE)
    server = {name for name in named if name.startswith("app/")}
    assert len(server) >= 40, sorted(server)  # a map of the server, not a sketch
    for package in ("app/http_protocol/", "app/tiers/disk/", "app/tiers/s3/"):
        assert any(name.startswith(package) for name in server), package


def test_the_architecture_names_every_module_of_the_sdk() -> None:
    named = named_modules(ARCHITECTURE)
    modules = {
        str(path.relative_to(ROOT))
        for path in SDK.rglob("*.py")
        if path.name != "__init__.py" or path.parent == SDK
    }
    assert len(modules) >= 40, sorted(modules)
    assert modules <= named, sorted(modules - named)


def test_every_module_a_document_names_exists() -> None:
    missing = {
        f"{document.relative_to(ROOT)}: {name}"
        for document in DOCUMENTS
        for name in named_modules(document)
        if not (ROOT / name).is_file()
    }
    assert not missing, sorted(missing)


def test_the_s3_file_table_lists_every_s3_module() -> None:
    text = (ROOT / "docs" / "s3.md").read_text()
    table = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `app/")}
    modules = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "app" / "tiers" / "s3").glob("*.py")
        if path.name != "__init__.py"
    }
    assert modules <= table, sorted(modules - table)


def test_every_relative_link_leads_to_a_file() -> None:
    broken = {
        f"{document.relative_to(ROOT)}: {target}"
        for document in DOCUMENTS
        for target in LINK.findall(document.read_text())
        if "://" not in target
        and not target.startswith("mailto:")
        and not (document.parent / target).exists()
    }
    assert not broken, sorted(broken)
