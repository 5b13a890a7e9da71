"""A bounded property-based fuzz of the server's own `/openapi.json` with schemathesis, so that the document
and what the server answers cannot drift apart: for a few operations (generation, tokenization, a model
lookup and the Open Inference Protocol's /v2 routes), requests generated from the document, valid and
invalid, must never get a 5xx, and every answer's status, content type and body must be the document's.

Generation is derandomized (the same cases every run) and has no deadline: a slow machine makes it slower,
never makes it fail. The wider runs (every operation, thousands of cases, OpenAI's own spec) are in the
README's testing section.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving import start_server, stop_server

pytestmark = pytest.mark.server

OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/v1/models/{model_id}"), ("GET", "/v2/models/{name}"),
              ("POST", "/v2/models/{name}/infer")]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(llama_dir):
    # a short context bounds what a generated request can ask the tiny model to generate
    proc, url = start_server(llama_dir, "--num-kv-blocks", "64", "--max-model-len", "64",
                             "--embedding-model", "none")
    yield url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def api_schema(server):
    # the fuzzing phase only (max_examples cases per operation): the coverage phase's boundary cases number
    # in the hundreds for the generation routes
    config = schemathesis.Config.from_dict({"phases": {"coverage": {"enabled": False},
                                                       "stateful": {"enabled": False}}})
    loaded = schemathesis.openapi.from_url(server + "/openapi.json", config=config)
    paths = loaded.raw_schema["paths"]
    missing = [(m, p) for m, p in OPERATIONS if m.lower() not in paths.get(p, {})]
    assert not missing, f"not in the document (renamed?): {missing}"  # the fuzz must not shrink unnoticed
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema").include(name=[f"{m} {p}" for m, p in OPERATIONS])


@schema.parametrize()
@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_answers_conform_to_the_servers_own_openapi_document(case):
    case.call_and_validate(checks=CHECKS, timeout=120)
