"""Control refusals carry no HTTP status: the server maps each kind to one (servelm/server/errors.py) and answers
in OpenAI's error shape. Each kind is checked through a real app, so a broken mapping changes what clients see."""

from __future__ import annotations

import inspect

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from servelm.control import errors
from servelm.server.errors import CONTROL_STATUS, control_api_error, install_error_handlers

EXPECTED = [
    (errors.InvalidRequest, 400, "invalid_request_error"),
    (errors.Forbidden, 403, "permission_error"),
    (errors.NotFound, 404, "not_found_error"),
    (errors.Conflict, 409, "conflict_error"),
    (errors.Unavailable, 503, "service_unavailable"),
    (errors.InsufficientMemory, 507, "insufficient_storage"),
]


def test_every_kind_of_refusal_has_a_status():
    kinds = {c for _, c in inspect.getmembers(errors, inspect.isclass)
             if issubclass(c, errors.ControlError) and c is not errors.ControlError}
    assert kinds == set(CONTROL_STATUS) == {cls for cls, _, _ in EXPECTED}


@pytest.mark.parametrize(("cls", "status", "kind"), EXPECTED)
def test_each_refusal_is_answered_with_its_status_and_the_openai_shape(cls, status, kind):
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/refuse")
    async def refuse():
        raise cls("no can do", code="some_reason", param="name")

    r = TestClient(app).get("/refuse")
    assert r.status_code == status
    assert r.json() == {"error": {"message": "no can do", "type": kind, "param": "name", "code": "some_reason"}}


def test_a_refusal_reworded_keeps_its_kind_and_the_field_defaults_to_the_callers():
    e = errors.Conflict("busy", code="deployment_exists")
    again = type(e)(f"{e.message}; m:1 keeps serving", e.code)
    err = control_api_error(again, "model")
    assert (err.status, err.message, err.param, err.code) == (409, "busy; m:1 keeps serving", "model",
                                                              "deployment_exists")
    assert control_api_error(errors.NotFound("gone", param="version"), "model").param == "version"


def test_a_subclass_answers_as_its_parent():
    class Unknown(errors.NotFound):
        pass

    assert control_api_error(Unknown("x")).status == 404
