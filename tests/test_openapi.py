"""GET /openapi.json describes what the bodies' validators accept, so that a
client or a fuzzer built from it sends what the server takes."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from openapi_spec_validator import validate
from pydantic import ValidationError

from frontend.openai_schemas import ChatBody, CompletionBody
from frontend.openapi import openapi_schema


def _components(strict_request_fields: bool) -> dict[str, Any]:
    schema = openapi_schema(strict_request_fields)
    validate(schema)
    components: dict[str, Any] = schema["components"]["schemas"]
    return components


def test_with_strict_request_fields_every_body_refuses_an_unknown_field() -> None:
    components = _components(strict_request_fields=True)
    for name in ("GenerateBody", "CompletionBody", "ChatBody", "TokenizeBody", "DetokenizeBody"):
        assert components[name]["additionalProperties"] is False, name
    for nested in ("ResponseFormat", "JsonSchemaFormat", "StreamOptions", "ChatMessage"):
        assert components[nested]["additionalProperties"] is False, nested


def test_by_default_only_generate_refuses_an_unknown_field() -> None:
    components = _components(strict_request_fields=False)
    assert components["GenerateBody"]["additionalProperties"] is False
    lenient = ("CompletionBody", "ChatBody", "TokenizeBody", "DetokenizeBody", "StreamOptions")
    for name in (*lenient, "ChatMessage"):
        assert "additionalProperties" not in components[name], name


@pytest.mark.parametrize("key", ["0", "7", "50256", "2147483647", "007", "x", "-1", "1.0", " 1"])
def test_a_logit_bias_key_is_described_as_the_validator_takes_it(key: str) -> None:
    described = _components(False)["CompletionBody"]["properties"]["logit_bias"]
    schema_takes = jsonschema.Draft202012Validator(described).is_valid({key: 1.0})
    try:
        CompletionBody.model_validate({"model": "m", "prompt": "p", "logit_bias": {key: 1.0}})
        validator_takes = True
    except ValidationError:
        validator_takes = False
    assert schema_takes == validator_takes


@pytest.mark.parametrize(
    ("body", "field", "values"),
    [
        (ChatBody, "tool_choice", [None, "none", "auto", "required"]),
        (ChatBody, "tools", [None, [], [{"type": "function"}]]),
        (CompletionBody, "suffix", [None, "", "after"]),
    ],
)
def test_an_unsupported_parameter_is_described_by_its_neutral_values(
    body: type[ChatBody | CompletionBody], field: str, values: list[Any]
) -> None:
    described = _components(False)[body.__name__]["properties"][field]
    least: dict[str, Any] = {"model": "m", "prompt": "p"}
    if body is ChatBody:
        least = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for value in values:
        server_takes = body.model_validate({**least, field: value}).unsupported() is None
        assert jsonschema.Draft202012Validator(described).is_valid(value) == server_takes, value


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {key for item in value.values() for key in _keys(item)}
    if isinstance(value, list):
        return {key for item in value for key in _keys(item)}
    return set()


def test_every_bound_is_in_json_schemas_words() -> None:
    """pydantic writes a bound it cannot place (on a type wrapped in a validator,
    in a union) as its own ge or le, which no JSON Schema validator reads."""
    for strict in (False, True):
        assert not _keys(openapi_schema(strict)) & {"ge", "gt", "le", "lt"}
    n = _components(False)["CompletionBody"]["properties"]["n"]["anyOf"][0]
    assert (n["minimum"], n["maximum"]) == (1, 8)
