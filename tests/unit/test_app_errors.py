"""Errors the app did not foresee still answer in the project's JSON format."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings


def test_an_unexpected_exception_is_a_json_500(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path, anonymous="read-write"))

    @app.get("/boom")
    async def boom() -> None:
        raise RecursionError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
    assert response.status_code == 500
    assert response.json() == {
        "error": "internal_error",
        "message": "internal server error (see the server log)",
        "part": None,
    }
