"""Request-body validation costs little and says little, whatever the body holds,
and large bodies hold up nothing else for long."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
from types import SimpleNamespace

import pytest
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from frontend import body as body_module
from frontend.body import MAX_JSON_CONTAINERS
from frontend.config import FrontendConfig
from frontend.errors import ApiError
from frontend.field_errors import MAX_REPORTED_ERRORS, FieldsAt, describe
from frontend.openai_schemas import ChatBody, CompletionBody
from frontend.parse import (
    LARGE_BODY_BYTES,
    check_num_fields,
    decode_body,
    drop_unknown,
    fields_in,
    parse_body,
)
from frontend.schemas import GenerateBody
from protocol.limits import MAX_CHAT_MESSAGES
from protocol.settings import load


def test_a_message_names_the_first_few_fields_and_counts_the_rest() -> None:
    bad = dict.fromkeys(
        ["max_new_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"], "x"
    )
    with pytest.raises(ValidationError) as caught:
        GenerateBody.model_validate({"prompt": 1, **bad})
    message, param = describe(caught.value)
    assert message.count(": must be ") == MAX_REPORTED_ERRORS
    assert message.endswith("; and 2 more")
    assert param == "prompt"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": "16"}, "max_tokens: must be an integer, got a string"),
        ({"temperature": True}, "temperature: must be a number, got a boolean"),
        (
            {"logit_bias": {"5": 10**400}},
            "logit_bias.5: must be a number, got an integer past a float's range (about 1.8e308)",
        ),
        ({"stream_options": 5}, "stream_options: must be an object, got an integer"),
        (
            {"prompt": {"a": 1}},
            "prompt: must be a string, an array of integers, an array of strings or an "
            "array of arrays of integers, got an object",
        ),
        ({"stop": None, "echo": "yes"}, "echo: must be true or false, got a string"),
        # An array, as one arm asks, with a bad item: the item is at fault.
        ({"stop": ["a", 5]}, "stop.1: must be a string, got an integer"),
        # As the arm that got furthest (list[int], to item 1) tells it alone.
        ({"prompt": [1, 2.5]}, "prompt.1: must be an integer, got a number"),
        ({"prompt": [[1], ["a"]]}, "prompt.1.0: must be an integer, got a string"),
    ],
)
def test_a_type_error_is_told_in_json_words(body: dict[str, object], expected: str) -> None:
    """Not pydantic's ("Input should be a valid dictionary or instance of
    StreamOptions", "must be str or list[int]"): the client wrote JSON."""
    with pytest.raises(ValidationError) as caught:
        CompletionBody.model_validate({"model": "m", "prompt": "hi", **body})
    message, param = describe(caught.value)
    assert message == expected
    assert param == expected.partition(":")[0]


@pytest.mark.parametrize(
    ("body", "field", "expected"),
    [
        ({"n": 2.0}, "n", 2),
        ({"max_tokens": 16.0}, "max_tokens", 16),
        ({"seed": 1e3}, "seed", 1000),
        ({"prompt": [1.0, 2]}, "prompt", [1, 2]),
        ({"prompt": [[1.0], [2]]}, "prompt", [[1], [2]]),
        ({"stop_token_ids": [7.0]}, "stop_token_ids", [7]),
    ],
)
def test_an_integer_written_with_a_point_is_an_integer(
    body: dict[str, object], field: str, expected: object
) -> None:
    """JSON has one number type, and JSON Schema (/openapi.json) calls 2.0 an
    integer: in a scalar field and in a list of token ids alike."""
    parsed = CompletionBody.model_validate({"model": "m", "prompt": "hi", **body})
    assert getattr(parsed, field) == expected
    assert repr(getattr(parsed, field)) == repr(expected)  # ints, not floats equal to them


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("1e300", "1e+300"),
        ("-1e20", "-1e+20"),
        ("1e400", "a number past a float's range"),
    ],
)
def test_an_integer_past_every_bound_is_refused_as_out_of_bounds(value: str, shown: str) -> None:
    """Not as "got a number": 1e300 is an integer to JSON, just past the bounds."""
    body = f'{{"model": "m", "prompt": "hi", "seed": {value}}}'.encode()
    with pytest.raises(ApiError) as caught:
        decode_body(body, CompletionBody, ignore_unknown=True)
    assert (
        caught.value.message == f"seed: must be an integer within this field's bounds, got {shown}"
    )


def test_a_number_past_a_floats_range_is_not_quoted_as_inf() -> None:
    body = b'{"model": "m", "prompt": "hi", "temperature": 1e400}'
    with pytest.raises(ApiError) as caught:
        decode_body(body, CompletionBody, ignore_unknown=True)
    assert (
        caught.value.message == "temperature: must be at most 2, got a number past a float's range"
    )


def test_a_missing_field_is_told_to_be_sent() -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionBody.model_validate({"prompt": "hi", "response_format": {}})
    message, param = describe(caught.value)
    assert message == "model: required; send it; response_format.type: required; send it"
    assert param == "model"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"temperature": 2.5}, "temperature: must be at most 2, got 2.5"),
        ({"top_p": 0}, "top_p: must be more than 0, got 0"),
        ({"min_p": 1.5}, "min_p: must be at most 1, got 1.5"),
        ({"n": 9}, "n: must be at most 8, got 9"),
        ({"stop": ["a"] * 5}, "stop: must have at most 4 items, got 5"),
        ({"logit_bias": {"7": -101}}, "logit_bias.7: must be at least -100, got -101"),
    ],
)
def test_a_value_out_of_range_is_told_its_bound(body: dict[str, object], expected: str) -> None:
    """Not pydantic's "List should have at most 4 items after validation, not 5"."""
    with pytest.raises(ValidationError) as caught:
        CompletionBody.model_validate({"model": "m", "prompt": "hi", **body})
    assert describe(caught.value) == (expected, expected.partition(":")[0])


def test_a_length_out_of_range_is_told_its_bound() -> None:
    with pytest.raises(ValidationError) as caught:
        ChatBody.model_validate({"model": "m", "messages": []})
    assert describe(caught.value) == ("messages: must not be empty", "messages")
    with pytest.raises(ValidationError) as caught:
        GenerateBody.model_validate({"prompt": "hi", "request_id": "r" * 200})
    assert describe(caught.value) == (
        "request_id: must be at most 128 characters, got 200",
        "request_id",
    )


@pytest.mark.parametrize("schema", [GenerateBody, CompletionBody, ChatBody])
@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        ({"stop": "x" * 257}, "stop: must be at most 256 characters, got 257"),
        ({"stop": ["a", "x" * 257]}, "stop.1: must be at most 256 characters, got 257"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids: must have at most 64 items, got 65"),
    ],
)
def test_the_workers_stop_limits_are_checked_here_too(
    schema: type[BaseModel], stops: dict[str, object], expected: str
) -> None:
    # Refused at once, not after waiting in the frontend for a worker's free slot.
    body = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    fields = {
        name: body[name] for name in ("model", "prompt", "messages") if name in schema.model_fields
    }
    with pytest.raises(ValidationError) as caught:
        schema.model_validate({**fields, **stops})
    assert describe(caught.value)[0] == expected
    at_the_limit = {"stop": ["x" * 256] * 4, "stop_token_ids": list(range(64))}
    schema.model_validate({**fields, **at_the_limit})


def test_an_array_item_of_the_wrong_type_in_a_chat_message_is_named() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [5]}]}
    with pytest.raises(ValidationError) as caught:
        ChatBody.model_validate(body)
    assert describe(caught.value) == (
        "messages.0.content.0: must be an object, got an integer",
        "messages.0.content.0",
    )


def test_an_unknown_field_is_told_the_nearest_field_or_all_of_them() -> None:
    fields = list(GenerateBody.model_fields)
    with pytest.raises(ValidationError) as caught:
        GenerateBody.model_validate({"prompt": "hi", "max_tokens": 4})
    assert describe(caught.value, _fields_in(GenerateBody)) == (
        "max_tokens: not a field of this body; did you mean max_new_tokens?",
        "max_tokens",
    )
    with pytest.raises(ValidationError) as caught:
        GenerateBody.model_validate({"prompt": "hi", "colour": "blue"})
    message, _ = describe(caught.value, _fields_in(GenerateBody))
    assert (
        message == f"colour: not a field of this body; this body's fields are {', '.join(fields)}"
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"stream_options": {"include_usge": True}},
            "stream_options.include_usge: not a field of stream_options; "
            "did you mean include_usage?",
        ),
        (
            {"stream_options": {"colour": 1}},
            "stream_options.colour: not a field of stream_options, whose fields are "
            "include_usage, continuous_usage_stats",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "nme": "x"}]},
            "messages.0.nme: not a field of messages.0; did you mean name?",
        ),
        (  # inside a union's arm (list[ContentPart]) of a list's item
            {"messages": [{"role": "user", "content": [{"type": "text", "txt": "a"}]}]},
            "messages.0.content.0.txt: not a field of messages.0.content.0; did you mean text?",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schem": {}}}},
            "response_format.json_schema.schem: not a field of response_format.json_schema; "
            "did you mean schema?",
        ),
    ],
)
def test_an_unknown_field_inside_an_object_is_told_that_objects_fields(
    body: dict[str, object], expected: str
) -> None:
    """STRICT_REQUEST_FIELDS' answer to a typo inside an object was "leave it
    out", with no word of the field meant."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(ValidationError) as caught:
        ChatBody.model_validate(chat)
    message, _ = describe(caught.value, _fields_in(ChatBody))
    assert expected in message


def test_another_servers_field_is_not_taken_for_a_typo_of_one_of_ours() -> None:
    """vLLM's length_penalty was answered "did you mean presence_penalty?"."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "length_penalty": 1}
    with pytest.raises(ValidationError) as caught:
        ChatBody.model_validate(chat)
    message, _ = describe(caught.value, _fields_in(ChatBody))
    assert message.startswith("length_penalty: not a field of this body; this body's fields")


def test_several_unknown_fields_name_the_bodys_fields_once() -> None:
    fields = list(GenerateBody.model_fields)
    unknown = {name: 1 for name in "abcdefg"}
    with pytest.raises(ValidationError) as caught:
        GenerateBody.model_validate({"prompt": "hi", **unknown})
    message, _ = describe(caught.value, _fields_in(GenerateBody))
    assert message.count(", ".join(fields)) == 1
    assert message.startswith("a: not a field of this body; b: not a field of this body; ")
    assert "; and 2 more; this body's fields are " in message


def test_a_long_unknown_field_name_is_shortened() -> None:
    with pytest.raises(ValidationError) as caught:
        GenerateBody.model_validate({"prompt": "hi", "x" * 10_000: 1})
    message, _ = describe(caught.value)
    assert len(message) < 100


def test_more_fields_than_the_schema_has_are_refused_naming_a_few() -> None:
    body = {"prompt": "hi", **{f"k{i}": 0 for i in range(1000)}}
    with pytest.raises(ApiError) as caught:
        check_num_fields(body, GenerateBody)
    assert caught.value.status == 422
    assert caught.value.message.startswith(
        "body: 1,000 unknown fields ('k0', 'k1', 'k2', 'k3', 'k4' and 995 more); the fields are "
    )


def test_a_nested_object_is_counted_against_its_own_schema() -> None:
    body = {"model": "m", "prompt": "hi", "stream_options": {"include_usage": True, "a": 1, "b": 2}}
    with pytest.raises(ApiError) as caught:
        check_num_fields(body, CompletionBody)
    assert caught.value.param == "stream_options"


def test_each_message_is_counted_against_its_own_schema() -> None:
    unknown = {key: 1 for key in "abcdefghij"}
    messages = [{"role": "user", "content": "hi"}, {"role": "user", **unknown}]
    with pytest.raises(ApiError) as caught:
        check_num_fields({"model": "m", "messages": messages}, ChatBody)
    assert caught.value.param == "messages.1"
    assert caught.value.message.startswith("messages.1: 10 unknown fields ('a', 'b', 'c', 'd', 'e'")


def test_unknown_fields_inside_messages_are_dropped_and_named() -> None:
    """As the body's own are: a misspelt field in a message is named to the client."""
    messages = [
        {"role": "system", "content": "be brief", "nmae": "rules"},
        {"role": "user", "content": "hi", "contnet": "typo", "name": "ann"},
    ]
    body = json.dumps({"model": "m", "messages": messages}).encode()
    parsed, ignored = decode_body(body, ChatBody, ignore_unknown=True)
    assert ignored == ["messages.0.nmae", "messages.1.contnet"]
    assert [message.content for message in parsed.messages] == ["be brief", "hi"]
    with pytest.raises(ApiError) as caught:
        decode_body(body, ChatBody, ignore_unknown=False)
    assert caught.value.status == 422
    assert caught.value.param == "messages.0.nmae"


def test_a_list_of_messages_past_its_bound_is_not_walked_before_it_is_refused() -> None:
    """Walking 32,000 messages for their unknown fields, only to refuse the list
    for its length, took seven times the event loop's time of the refusal."""
    messages = [{"role": "user", "content": "hi", "x": 1}] * (MAX_CHAT_MESSAGES + 1)
    dropped: list[str] = []
    drop_unknown({"model": "m", "messages": messages}, ChatBody, dropped)
    assert dropped == []
    body = json.dumps({"model": "m", "messages": messages}).encode()
    with pytest.raises(ApiError) as caught:
        decode_body(body, ChatBody, ignore_unknown=True)
    assert caught.value.message.startswith("messages: must have at most 256 items")


@pytest.mark.parametrize("strict", [False, True])
def test_an_array_for_a_field_of_one_object_is_refused_as_an_array(strict: bool) -> None:
    body = b'{"model": "m", "prompt": "x", "stream": true, "stream_options": [{"a": 1, "b": 2}]}'
    with pytest.raises(ApiError) as caught:
        decode_body(body, CompletionBody, ignore_unknown=not strict)
    assert caught.value.message == "stream_options: must be an object, got an array"


@pytest.mark.parametrize("strict", [False, True])
def test_an_unknown_field_in_a_content_part_is_named_or_refused(strict: bool) -> None:
    """Parts were plain objects: a misspelt field in one went unseen either way."""
    part = {"type": "text", "text": "hi", "txet": "typo"}
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]})
    if not strict:
        _, ignored = decode_body(body.encode(), ChatBody, ignore_unknown=True)
        assert ignored == ["messages.0.content.0.txet"]
        return
    with pytest.raises(ApiError) as caught:
        decode_body(body.encode(), ChatBody, ignore_unknown=False)
    assert caught.value.param == "messages.0.content.0.txet"


def test_a_conversation_as_openai_answers_it_passes_strict_checks() -> None:
    """OpenAI's and vLLM's answers carry refusal: null back in the history."""
    assistant = {"role": "assistant", "content": "hi", "refusal": None, "audio": None}
    messages = [assistant | {"function_call": None}, {"role": "user", "content": "x"}]
    body = json.dumps({"model": "m", "messages": messages}).encode()
    parsed, ignored = decode_body(body, ChatBody, ignore_unknown=False)
    assert len(parsed.messages) == 2 and ignored == []


def test_a_few_unknown_fields_are_left_to_pydantic() -> None:
    check_num_fields({"prompt": "hi", "promt": "typo"}, GenerateBody)


def test_a_body_of_countless_tiny_arrays_is_refused_before_it_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A megabyte of [[1],[1],...] took 0.3-0.5 s of the event loop to parse and
    validate on a busy Zen 4 EPYC, 5-10 times a megabyte of token ids: past the limit of arrays
    and objects, a body is refused unparsed. The outer object and list count."""
    at_limit = {"model": "m", "prompt": [[1]] * (MAX_JSON_CONTAINERS - 2)}
    parsed, _ = decode_body(json.dumps(at_limit).encode(), CompletionBody, ignore_unknown=True)
    assert len(parsed.prompt) == MAX_JSON_CONTAINERS - 2

    def no_parse(text: bytes) -> None:
        raise AssertionError("parsed a body past the limit")

    monkeypatch.setattr(body_module, "parse_json", no_parse)
    past_limit = {"model": "m", "prompt": [[1]] * (MAX_JSON_CONTAINERS - 1)}
    with pytest.raises(ApiError) as caught:
        decode_body(json.dumps(past_limit).encode(), CompletionBody, ignore_unknown=True)
    assert caught.value.status == 422
    assert f"{MAX_JSON_CONTAINERS + 1:,} JSON arrays and objects" in caught.value.message


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "never_closed", [b'"\\' * 500_000, b'"' * 999_999, b'"\\\n' * 300_000, b'"abc\\']
)
def test_counting_past_the_limit_takes_one_pass_whatever_the_strings(never_closed: bytes) -> None:
    """A string that never closes, its quotes each scanned again to the end of
    the body, made the count quadratic: on a Zen 4 EPYC, 0.74 s of the event loop
    for 44 KB and 20 s for 104 KB."""
    body = b"[" * (MAX_JSON_CONTAINERS + 1) + never_closed
    with pytest.raises(ApiError) as caught:
        decode_body(body, CompletionBody)
    assert f"{MAX_JSON_CONTAINERS + 1:,} JSON arrays and objects" in caught.value.message


def test_brackets_within_strings_are_no_arrays() -> None:
    """A prompt of code holds brackets by the thousand, escaped quotes too."""
    prompt = 'x["a"] = {"b": [1]}\n' * MAX_JSON_CONTAINERS
    body = json.dumps({"model": "m", "prompt": prompt, "stop": ["]", '"['], "max_tokens": 1})
    parsed, _ = decode_body(body.encode(), CompletionBody, ignore_unknown=True)
    assert parsed.prompt == prompt


def test_large_bodies_are_validated_one_per_turn_of_the_event_loop() -> None:
    """A burst of large bodies, ~40 ms each to validate, must not hold the loop
    for all of them at once: between one and the next, the loop goes round (so
    /health and the workers' heartbeats are served). Small bodies go at once."""
    large = json.dumps({"model": "m", "prompt": [1] * (LARGE_BODY_BYTES // 2)}).encode()
    small = json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode()
    app = SimpleNamespace(
        state=SimpleNamespace(config=load(FrontendConfig, [], {}), large_body_turn=asyncio.Lock())
    )
    scope = {
        "type": "http",
        "method": "POST",
        "headers": [(b"content-type", b"application/json")],
        "app": app,
    }
    turns = 0

    async def parse(body: bytes) -> int:
        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        await parse_body(Request(scope, receive), CompletionBody, ignore_unknown=True)
        return turns

    async def count_turns() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    async def burst() -> tuple[list[int], list[int]]:
        counter = asyncio.create_task(count_turns())
        await asyncio.sleep(0)
        large_done = await asyncio.gather(*(parse(large) for _ in range(4)))
        small_done = await asyncio.gather(*(parse(small) for _ in range(4)))
        counter.cancel()
        return large_done, small_done

    large_done, small_done = asyncio.run(burst())
    assert all(later > earlier for earlier, later in itertools.pairwise(large_done))
    assert len(set(small_done)) == 1


def _fields_in(schema: type[BaseModel]) -> FieldsAt:
    return functools.partial(fields_in, schema)
