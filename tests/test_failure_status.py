"""A FAILED request's HTTP answer in each protocol (SPEC L4, L5; issue 23 item 1): the engine
may refuse a request only after the server accepted it (several models: a request that waited
for its model's load is checked by that model's engine), and a defect of the request is then
still the client's error — HTTP 400 with the protocol's ``invalid_request_error`` — while every
other failure stays a 500 that the SDKs do not retry."""

from __future__ import annotations

import json

import pytest

from coda.errors import ErrorCode
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.server.http_errors import anthropic_error, failed_json, openai_error

REQUEST_FAULTS = {ErrorCode.INVALID_REQUEST, ErrorCode.CONTEXT_LENGTH_EXCEEDED}


def _failed(code: ErrorCode) -> Terminal:
    return Terminal(State.FAILED, FinishReason.MODEL_ERROR, Usage(), error_code=code,
                    error_message=f"failed: {code.value}")


@pytest.mark.parametrize("code", list(ErrorCode))
def test_l4_l5_failed_status_and_error_type_follow_whose_fault_it_is(code: ErrorCode) -> None:
    terminal = _failed(code)
    client_fault = code in REQUEST_FAULTS
    response = failed_json({"error": openai_error(terminal)}, terminal, headers={"a": "b"})
    assert response.status_code == (400 if client_fault else 500)
    assert response.headers["x-should-retry"] == "false" and response.headers["a"] == "b"
    body = json.loads(bytes(response.body))
    assert body["error"]["code"] == code.value
    assert body["error"]["type"] == ("invalid_request_error" if client_fault else "server_error")
    assert anthropic_error(terminal)["type"] == (
        "invalid_request_error" if client_fault else "api_error")
