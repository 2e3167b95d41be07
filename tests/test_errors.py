"""A worker's refusal names the field at fault as the client's body names it."""

from __future__ import annotations

import pytest

from frontend.errors import ApiError
from protocol import ErrorCode, ErrorResult, GrammarKind


def _refusal(message: str, field_names: dict[str, str] | None = None) -> ApiError:
    error = ErrorResult("r1", ErrorCode.INVALID_REQUEST, message)
    return ApiError.from_worker(error, field_names or {})


@pytest.mark.parametrize(
    "field", ["min_tokens", "cache_salt", "top_k", "echo", "add_generation_prompt", "stop"]
)
def test_a_field_the_body_names_alike_is_the_param_with_no_mapping(field: str) -> None:
    refused = _refusal(f"{field}: must be something else")
    assert (refused.param, refused.message) == (field, f"{field}: must be something else")


@pytest.mark.parametrize(
    ("worker_field", "param"),
    [
        ("prompt_token_ids", "prompt"),
        ("prompt_logprobs", "logprobs"),
        ("chat_contents", "messages"),
        ("logit_bias", "logit_bias"),
        (GrammarKind.field(GrammarKind.REGEX), "structured_outputs.regex"),
    ],
)
def test_a_field_split_or_renamed_on_the_wire_is_named_as_the_body_has_it(
    worker_field: str, param: str
) -> None:
    refused = _refusal(f"{worker_field}: too long")
    assert (refused.param, refused.message) == (param, f"{param}: too long")


def test_an_endpoints_own_name_wins() -> None:
    refused = _refusal("max_new_tokens: too many", {"max_new_tokens": "max_tokens"})
    assert (refused.param, refused.message) == ("max_tokens", "max_tokens: too many")


@pytest.mark.parametrize(
    "message",
    [
        "resume_token_ids: token 3 is not one the output had",  # the frontend's own field
        "request_id: must be 1 to 256 characters, got 300",
        "RuntimeError: the engine failed",  # a colon, but no field
    ],
)
def test_a_refusal_of_no_client_field_names_no_param(message: str) -> None:
    refused = _refusal(message)
    assert (refused.param, refused.message) == (None, message)
