"""Schemathesis against the server's own OpenAPI document: whatever the fuzzer sends, the server
answers no 5xx, and every answer (status, content type, body) is one the document describes.

The document is the one `create_app` builds (the one `/openapi.json` serves, checked below), read
at import so that schemathesis makes one test per operation; the requests go to a live server.
Every operation is fuzzed (none excluded), positive and negative cases, with an API key set so the
401s are documented ones too. Bounded to stay quick on two cores: a tiny engine, `max_n=2` and
`max_tokens_limit=16` (OpenAI's default `max_tokens` for completions, so a completion that leaves it
out is still accepted) so no request asks for a long generation, and 15 examples per operation
besides schemathesis's coverage cases.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from agentrt.server import create_app
from tests.server.live import live_server, tiny_config

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
DOCUMENT = create_app().state.openapi  # built without starting the app: no model is loaded

schema = schemathesis.openapi.from_dict(DOCUMENT)


@pytest.fixture(scope="module")
def server(tiny_model_path):
    with live_server(tiny_config(tiny_model_path, max_tokens_limit=16, max_n=2, api_keys=[KEY])) as s:
        yield s


def test_served_document_is_the_fuzzed_one(server):
    r = httpx.get(f"{server.url}/openapi.json", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == DOCUMENT


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi_document(case, server):
    case.call_and_validate(base_url=server.url, headers=AUTH, checks=CHECKS, timeout=30)
