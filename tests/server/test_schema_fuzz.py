"""Schemathesis against ``kvrag serve``'s own OpenAPI document, every endpoint, valid and invalid
requests, on a server with and without API keys: no 5xx, every error a JSON body in OpenAI's shape.

Bounded (a few examples per mode and server) so that it stays a unit test; the tiny random Llama
with a 128-token window keeps each request cheap.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

import httpx  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from kvrag.server import ServerSettings, TenantMap  # noqa: E402
from kvrag.server.guard import OPEN_PATHS  # noqa: E402

EXAMPLES = 100  # per generation mode and server: 400 requests in all, ~15 s on one shared core


def check_answer(status: int, content_type: str, content: bytes, where: str) -> None:
    """No server fault; an error is JSON in OpenAI's shape."""
    assert status < 500, f"{where}: {status} {content[:300]!r}"
    if status >= 400:
        assert content_type.startswith("application/json"), f"{where}: {status} {content_type} {content[:300]!r}"
        error = json.loads(content)["error"]
        assert set(error) >= {"message", "type", "param", "code"}, where
        assert isinstance(error["message"], str) and error["message"], where


@pytest.mark.parametrize("keyed", [False, True], ids=["no-keys", "api-keys"])
def test_every_endpoint_answers_in_openai_shape(serve_tiny, keyed):
    tenants = TenantMap(api_keys={"key-a": "tenant-a"}) if keyed else TenantMap()
    engine, url = serve_tiny(ServerSettings(tenants=tenants), max_context=128)
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    headers = {"Authorization": "Bearer key-a"} if keyed else {}
    seen = set()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=schema.as_strategy(generation_mode=mode))
        def call(case):
            response = case.call(base_url=url, headers=headers, timeout=60)
            where = f"{case.method} {case.formatted_path} {case.body!r:.200}"
            content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis: header -> values
            check_answer(response.status_code, content_type, response.content, where)
            seen.add(case.path)

        call()
    assert len(seen) >= 8  # every endpoint was reached (a few paths share one operation shape)
    if keyed:  # without the key every path but the open ones is refused, before its body is read
        paths = {p for p in schema.raw_schema["paths"] if "{" not in p} - OPEN_PATHS
        for path in paths:
            method = "GET" if "get" in schema.raw_schema["paths"][path] else "POST"
            r = httpx.request(method, f"{url}{path}", content=b"{not json", timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
