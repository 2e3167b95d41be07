from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    Admitted,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    Heartbeat,
    Hello,
    Logprobs,
    Ping,
    ProtocolError,
    TokenDelta,
    VersionMismatch,
    Waiting,
    decode_to_frontend,
    decode_to_worker,
    encode,
)
from protocol.checks import Schema
from protocol.limits import MIN_MESSAGE_BYTES
from protocol.messages import ERROR_CODES, FINISH_REASONS, TO_FRONTEND, TO_WORKER
from tests.stand_in_worker import stand_in_hello

texts = st.text(max_size=40)
ids = st.lists(st.integers(min_value=0, max_value=2**31), max_size=20)
counts = st.integers(min_value=0, max_value=2**31)
floats = st.floats(allow_nan=False, allow_infinity=False)
times = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
# Logprobs travel as float32: these survive the trip exactly.
float32s = st.floats(width=32, allow_nan=False, max_value=0.0)


@st.composite
def logprobs(draw: st.DrawFn) -> Logprobs:
    """Logprobs whose lists agree, as `Logprobs` checks: each token and its
    num_top alternatives with a text and bytes of their own."""
    num_tokens = draw(st.integers(min_value=0, max_value=6))
    num_top = draw(st.integers(min_value=0, max_value=3))
    num_entries = num_tokens * (1 + num_top)

    def exactly(items: st.SearchStrategy[Any], size: int) -> list[Any]:
        return draw(st.lists(items, min_size=size, max_size=size))

    token_id = st.integers(min_value=0, max_value=2**31)
    entry_texts = exactly(st.text(max_size=4), num_entries)
    entry_bytes = exactly(st.binary(max_size=4), num_entries)
    return Logprobs(
        num_top=num_top,
        token_ids=exactly(token_id, num_tokens),
        logprobs=exactly(float32s, num_tokens),
        top_token_ids=exactly(token_id, num_tokens * num_top),
        top_logprobs=exactly(float32s, num_tokens * num_top),
        texts="".join(entry_texts),
        text_lens=[len(text) for text in entry_texts],
        token_bytes=b"".join(entry_bytes),
        byte_lens=[len(piece) for piece in entry_bytes],
    )


@st.composite
def results(draw: st.DrawFn) -> GenerateResult:
    """Results that agree with themselves, as `GenerateResult` checks: a count per
    output token (and prompt token, where their ids travel), times that are times,
    cached tokens within those looked up."""
    token_ids = draw(ids)
    prompt_token_ids = draw(st.none() | ids)
    prompt_tokens = draw(counts) if prompt_token_ids is None else len(prompt_token_ids)
    looked_up = draw(st.integers(min_value=0, max_value=prompt_tokens))
    return GenerateResult(
        request_id=draw(texts),
        text=draw(texts),
        token_ids=token_ids,
        finish_reason=draw(st.sampled_from(FINISH_REASONS)),
        prompt_tokens=prompt_tokens,
        completion_tokens=len(token_ids),
        queue_wait_ms=draw(times),
        generate_ms=draw(times),
        prompt_logprobs=draw(st.none() | logprobs()),
        prompt_token_ids=prompt_token_ids,
        prompt_text=draw(st.none() | texts),
        looked_up_tokens=looked_up,
        cached_tokens=draw(st.integers(min_value=0, max_value=looked_up)),
    )


to_worker = st.one_of(
    st.builds(
        GenerateRequest,
        request_id=texts,
        prompt=texts,
        max_new_tokens=counts,
        prompt_token_ids=st.none() | ids,
        resume_token_ids=ids,
        resume_text_len=counts,
        stop_token_ids=ids,
        stop=st.lists(texts, max_size=4),
        ignore_eos=st.booleans(),
        temperature=floats,
        top_p=floats,
        top_k=counts,
        seed=st.none() | counts,
        stream=st.booleans(),
        min_tokens=counts,
        repetition_penalty=floats,
        logit_bias_token_ids=ids,
        logit_bias_values=st.lists(float32s, max_size=20),
        logprobs=st.none() | counts,
        chat_roles=st.lists(texts, max_size=4),
        chat_contents=st.lists(texts, max_size=4),
        echo=st.booleans(),
        grammar_kind=texts,
        grammar=texts,
    ),
    st.builds(AbortRequest, request_id=texts),
    st.builds(Ping, frontend_id=texts),
)
to_frontend = st.one_of(
    st.builds(
        Hello,
        instance_id=texts,
        model=texts,
        is_random_weights=st.booleans(),
        capacity=st.integers(min_value=1, max_value=2**31),
        context_window=st.integers(min_value=1, max_value=2**31),
        max_queue_depth=st.integers(min_value=1, max_value=2**31),
        max_message_bytes=st.integers(min_value=MIN_MESSAGE_BYTES, max_value=2**31),
    ),
    st.builds(
        Heartbeat,
        instance_id=texts,
        num_steps=counts,
        num_queued=counts,
        num_active=counts,
        num_finished=counts,
    ),
    st.builds(
        TokenDelta, request_id=texts, token_ids=ids, text=texts, logprobs=st.none() | logprobs()
    ),
    results(),
    st.builds(ErrorResult, request_id=texts, code=st.sampled_from(ERROR_CODES), message=texts),
    st.builds(Waiting, request_id=texts),
    st.builds(Admitted, request_id=texts),
)


@given(to_worker)
def test_every_message_to_the_worker_survives_a_round_trip(message: object) -> None:
    assert decode_to_worker(encode(message)) == message  # type: ignore[arg-type]


@given(to_frontend)
def test_every_message_to_the_frontend_survives_a_round_trip(message: object) -> None:
    assert decode_to_frontend(encode(message)) == message  # type: ignore[arg-type]


def test_every_message_type_is_covered_by_the_round_trip_strategies() -> None:
    assert {cls.TYPE for cls in TO_WORKER} == {"generate", "abort", "ping"}
    assert {cls.TYPE for cls in TO_FRONTEND} == {
        "hello",
        "heartbeat",
        "waiting",
        "admitted",
        "delta",
        "result",
        "error",
    }


def _frame(**fields: object) -> bytes:
    payload = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": "r1", "prompt": "hi"}
    payload["max_new_tokens"] = 4
    payload.update(fields)
    return msgpack.packb({k: v for k, v in payload.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (b"\xc1", "must be a msgpack map"),
        (b"", "not valid msgpack"),
        (msgpack.packb([1, 2]), "must be a msgpack map"),
        (_frame(v=PROTOCOL_VERSION + 1), "protocol version"),
        (_frame(v=_DROP), "no protocol version (got None)"),
        (_frame(v="8"), "no protocol version"),
        (_frame(type="result"), "not expected here"),
        (_frame(type="nonsense"), "not expected here"),
        (_frame(max_new_tokens="4"), "max_new_tokens must be int"),
        (_frame(max_new_tokens=True), "max_new_tokens must be int"),
        (_frame(stop=["a", 3]), "stop must be a list of str"),
        (_frame(seed=1.5), "seed must be int or null"),
        (_frame(prompt=_DROP), "missing fields ['prompt']"),
        (_frame(colour="red"), "unknown fields 'colour'"),
        (_frame(stop=["a"] * 257), "a list of 257 items; at most 256"),
        (msgpack.packb({str(i): i for i in range(65)}), "a map of 65 entries; at most 64"),
        (_frame(prompt=[[]]), "'prompt': no field nests lists"),
        (_frame(stop={"a": 1}), "'stop': no field is a map"),
        (msgpack.packb({(1,): 2}), "a container for a field name"),
        (_frame(request_id="r" * 257), "request_id is 257 characters; at most 256"),
        (_frame() + b"\x00", "not valid msgpack"),
        (_frame(stop_token_ids=[1, 2]), "stop_token_ids must be token ids packed as"),
        (_frame(prompt_token_ids=b"\x01\x00\x00"), "prompt_token_ids must be token ids packed"),
        (_frame(logit_bias_values=[1.0]), "logit_bias_values must be numbers packed as"),
        (_frame(logit_bias_token_ids=b"\x01"), "logit_bias_token_ids must be token ids packed"),
        (msgpack.packb({1: 2}), "not valid msgpack"),
    ],
)
def test_malformed_frames_raise_protocol_error(frame: bytes, expected: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(expected)):
        decode_to_worker(frame)


@pytest.mark.parametrize(
    ("version", "is_mismatch"),
    [(PROTOCOL_VERSION + 1, True), (1, True), (None, False), (True, False)],
)
def test_only_another_version_number_is_a_version_mismatch(
    version: object, is_mismatch: bool
) -> None:
    """A worker answers a mismatch with its hello; a map without a version is
    only malformed, and was reported as "protocol version None"."""
    with pytest.raises(ProtocolError) as raised:
        decode_to_worker(_frame(v=version))
    assert isinstance(raised.value, VersionMismatch) == is_mismatch


@pytest.mark.parametrize("nested", [{"a": 1}, [[1]]])
def test_another_versions_frame_of_another_shape_is_a_version_mismatch(nested: object) -> None:
    """A later version's ping may carry a map or nested lists, which this version's
    shape check refuses before the frame is unpacked: the version, written first,
    still names the mismatch, so the worker answers with its hello."""
    with pytest.raises(VersionMismatch, match="protocol version 99"):
        decode_to_worker(msgpack.packb({"v": 99, "type": "ping", "options": nested}))
    for version in (PROTOCOL_VERSION, True):  # this version's own, or none: only malformed
        with pytest.raises(ProtocolError, match="no field") as raised:
            decode_to_worker(msgpack.packb({"v": version, "type": "ping", "x": nested}))
        assert not isinstance(raised.value, VersionMismatch)


@pytest.mark.parametrize("decode", [decode_to_worker, decode_to_frontend])
def test_a_field_name_that_is_bytes_is_refused(decode: Callable[[bytes], object]) -> None:
    """msgpack lets bytes keys through its strict_map_key; beside a string one,
    sorting the unknown names raised TypeError and ended the receiving process."""
    kind = "ping" if decode is decode_to_worker else "heartbeat"
    payload = {"v": PROTOCOL_VERSION, "type": kind, b"zz": 1, "yy": 2}
    with pytest.raises(ProtocolError, match=re.escape("field names must be strings, got b'zz'")):
        decode(msgpack.packb(payload, use_bin_type=True))


def test_whatever_building_a_message_raises_is_a_protocol_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The receiving loops survive only ProtocolError: a check that misses a
    frame must not turn it into the end of the process."""

    def broken(*_: object) -> None:
        raise TypeError("a check missed this")

    monkeypatch.setattr(Schema, "build", broken)
    frame = encode(Ping("f"))
    with pytest.raises(ProtocolError, match="ping: cannot be built from this frame"):
        decode_to_worker(frame)


def test_truncated_frames_raise_protocol_error() -> None:
    frame = encode(GenerateRequest("r1", "a prompt", 8, stop=["x"]))
    for cut in range(len(frame)):
        with pytest.raises(ProtocolError):
            decode_to_worker(frame[:cut])


def test_a_bad_frame_that_names_a_request_keeps_its_id_so_it_can_be_answered() -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_to_worker(_frame(max_new_tokens="4"))
    assert caught.value.request_id == "r1"


def test_a_frame_with_a_string_that_is_not_utf8_keeps_its_request_id() -> None:
    """msgpack cannot decode such a frame as text; its request id, read as bytes,
    still names the request to answer (a frontend's waited REQUEST_TIMEOUT_S)."""
    frame = _frame(prompt="\x00BAD").replace(b"\xa4\x00BAD", b"\xa4\xff\xfe\xfd\xfc")
    with pytest.raises(ProtocolError, match="not valid msgpack") as caught:
        decode_to_worker(frame)
    assert caught.value.request_id == "r1"
    nameless = _frame(request_id="\x00BAD").replace(b"\xa4\x00BAD", b"\xa4\xff\xfe\xfd\xfc")
    with pytest.raises(ProtocolError) as caught:
        decode_to_worker(nameless)
    assert caught.value.request_id is None


def test_a_frame_that_nests_containers_is_refused_before_it_is_built() -> None:
    # 2 MiB of empty lists, 256 wide and 3 deep: two million Python objects if it
    # were unpacked, refused at its first nested header instead, still answerable.
    leaf = b"\xdc\x01\x00" + b"\x90" * 256
    tree = b"\xdc\x01\x00" + (b"\xdc\x00\x1e" + leaf * 30) * 256
    head = msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate", "request_id": "r1"})
    entries = head[1:] + msgpack.packb("max_new_tokens") + b"\x04" + msgpack.packb("prompt")
    frame = b"\x85" + entries + tree
    assert len(frame) > 1_900_000
    with pytest.raises(ProtocolError, match="no field nests lists") as caught:
        decode_to_worker(frame)
    assert caught.value.request_id == "r1"


def test_an_over_long_request_id_is_refused_without_being_echoed() -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_to_worker(_frame(request_id="r" * 2_000_000))
    assert caught.value.request_id is None
    assert len(str(caught.value)) < 100


def test_a_frontend_message_is_refused_on_the_worker_side_and_vice_versa() -> None:
    with pytest.raises(ProtocolError, match="not expected here"):
        decode_to_worker(encode(Heartbeat("i", 1, 0, 0)))
    with pytest.raises(ProtocolError, match="not expected here"):
        decode_to_frontend(encode(AbortRequest("r1")))


def test_token_ids_travel_as_little_endian_uint32() -> None:
    frame = encode(GenerateRequest("r1", "", 4, prompt_token_ids=[1, 50256, 2**32 - 1]))
    payload = msgpack.unpackb(frame)
    assert payload["prompt_token_ids"] == b"\x01\x00\x00\x00\x50\xc4\x00\x00\xff\xff\xff\xff"
    assert payload["resume_token_ids"] == b""


def test_ids_that_do_not_fit_uint32_are_refused_at_encode() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        encode(GenerateRequest("r1", "", 4, prompt_token_ids=[-1]))


@pytest.mark.parametrize(
    "frame",
    [
        _frame(max_new_tokens="9" * 1_000_000),
        _frame(v="9" * 100_000),  # the version, and the type, are quoted back
        _frame(type="t" * 100_000),
    ],
)
def test_an_error_message_stays_short_whatever_the_input(frame: bytes) -> None:
    """A message naming a request goes back to its peer."""
    with pytest.raises(ProtocolError) as caught:
        decode_to_worker(frame)
    assert len(str(caught.value)) < 200


@pytest.mark.parametrize("value", [1, 2**64 - 1, -(2**63)])
def test_a_float_field_takes_a_json_style_integer_as_a_float(value: int) -> None:
    """The engine computes with it: torch would make an integer tensor of an int,
    and one past 2**63 would overflow in the step, failing every sequence in it."""
    payload = msgpack.unpackb(encode(GenerateRequest("r1", "hi", 4)))
    payload["temperature"] = value
    temperature = decode_to_worker(msgpack.packb(payload)).temperature  # type: ignore[union-attr]
    assert type(temperature) is float and temperature == float(value)


def test_logprobs_travel_as_packed_float32_bytes() -> None:
    scores = Logprobs(
        2,
        [5, 6],
        [-0.5, math.nan],
        [5, 7, 6, 8],
        [-0.5, -1.0, -2.0, -3.0],
        "abcdef",
        [1] * 6,
        b"abcdef",
        [1] * 6,
    )
    frame = encode(TokenDelta("r", [5, 6], "x", logprobs=scores))
    packed = msgpack.unpackb(frame)["logprobs"]
    assert packed["logprobs"] == struct.pack("<2f", -0.5, math.nan)
    decoded = decode_to_frontend(frame)
    assert isinstance(decoded, TokenDelta) and decoded.logprobs is not None
    assert decoded.logprobs.top_logprobs == [-0.5, -1.0, -2.0, -3.0]
    assert math.isnan(decoded.logprobs.logprobs[1])


def test_a_logit_bias_travels_as_packed_ids_and_float32_values() -> None:
    frame = encode(
        GenerateRequest(
            "r1", "hi", 4, logit_bias_token_ids=[7, 50256], logit_bias_values=[-100, 2.5]
        )
    )
    payload = msgpack.unpackb(frame)
    assert payload["logit_bias_token_ids"] == struct.pack("<2I", 7, 50256)
    assert payload["logit_bias_values"] == struct.pack("<2f", -100.0, 2.5)
    decoded = decode_to_worker(frame)
    assert isinstance(decoded, GenerateRequest)
    assert (decoded.logit_bias_token_ids, decoded.logit_bias_values) == ([7, 50256], [-100.0, 2.5])


def test_a_request_from_before_logit_bias_decodes_without_one() -> None:
    payload = msgpack.unpackb(encode(GenerateRequest("r1", "hi", 4)))
    del payload["logit_bias_token_ids"], payload["logit_bias_values"]
    decoded = decode_to_worker(msgpack.packb(payload))
    assert isinstance(decoded, GenerateRequest)
    assert (decoded.logit_bias_token_ids, decoded.logit_bias_values) == ([], [])


def test_a_grammar_travels_with_its_kind_and_a_request_from_before_them_has_none() -> None:
    grammar = '{"grammars": [{"json_schema": {"type": "object"}}]}'
    request = GenerateRequest("r1", "hi", 4, grammar_kind="json_object", grammar=grammar)
    assert decode_to_worker(encode(request)) == request
    payload = msgpack.unpackb(encode(GenerateRequest("r1", "hi", 4)))
    del payload["grammar_kind"], payload["grammar"]
    decoded = decode_to_worker(msgpack.packb(payload))
    assert isinstance(decoded, GenerateRequest)
    assert (decoded.grammar_kind, decoded.grammar) == ("", "")


def _result_frame(**fields: object) -> bytes:
    payload: dict[str, object] = {"v": PROTOCOL_VERSION, "type": "result", "request_id": "r1"}
    payload |= {"text": "", "token_ids": b"", "finish_reason": "length", "prompt_tokens": 3}
    payload |= {"completion_tokens": 0, "queue_wait_ms": 0.0, "generate_ms": 0.0}
    return msgpack.packb(payload | fields)


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (
            _result_frame(completion_tokens=-1),
            "result.completion_tokens must be at least 0, got -1",
        ),
        (_result_frame(cached_tokens=-5), "result.cached_tokens must be at least 0, got -5"),
        (
            msgpack.packb(
                {"v": PROTOCOL_VERSION, "type": "heartbeat", "instance_id": "i"}
                | {"num_steps": 1, "num_queued": 0, "num_active": -8}
            ),
            "heartbeat.num_active must be at least 0, got -8",
        ),
        (
            msgpack.packb(
                {"v": PROTOCOL_VERSION, "type": "error", "request_id": "r1"}
                | {"code": "teapot", "message": "x" * 100_000}
            ),
            "unknown code 'teapot'",
        ),
    ],
)
def test_a_worker_answer_with_a_negative_count_or_an_unknown_code_is_refused(
    frame: bytes, problem: str
) -> None:
    """A count below 0 raised in the frontend's metrics (a 500 with a traceback
    for every request on that worker), and an unknown code went to the client.
    The request named keeps its id, so that it can be failed, not left waiting."""
    with pytest.raises(ProtocolError, match=re.escape(problem)) as caught:
        decode_to_frontend(frame)
    assert caught.value.request_id == ("r1" if b"r1" in frame else None)
    assert len(str(caught.value)) < 400


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"queue_wait_ms": -0.5}, "queue_wait_ms must be a finite time of at least 0"),
        ({"generate_ms": math.inf}, "generate_ms must be a finite time of at least 0"),
        ({"completion_tokens": 1}, "completion_tokens 1 for 0 token ids"),
        ({"looked_up_tokens": 4}, "looked_up_tokens 4 and prompt_tokens 3: each must be"),
    ],
)
def test_a_result_that_disagrees_with_itself_fails_its_request(
    fields: dict[str, object], problem: str
) -> None:
    with pytest.raises(ProtocolError, match=problem) as refused:
        decode_to_frontend(_result_frame(**fields))
    assert refused.value.request_id == "r1"  # that request fails, not the connection


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"context_window": 0}, "context_window must be at least 1, got 0"),
        ({"capacity": 0}, "capacity must be at least 1, got 0"),
        ({"max_queue_depth": 0}, "max_queue_depth must be at least 1, got 0"),
        ({"max_message_bytes": 1}, "max_message_bytes must be at least 262,144"),
    ],
)
def test_a_hello_with_limits_no_worker_has_is_refused(
    fields: dict[str, object], problem: str
) -> None:
    """Taken, they made every request the client's fault: 'the request is 553
    bytes on the wire, more than the worker accepts', a 422; or, a worker with
    no slot, held every request sent to it until its timeout."""
    payload = msgpack.unpackb(encode(stand_in_hello()))
    with pytest.raises(ProtocolError, match=problem):
        decode_to_frontend(msgpack.packb({**payload, **fields}))


@pytest.mark.parametrize(
    ("logprobs", "problem"),
    [
        ({"logprobs": b"abc"}, "logprobs must be numbers packed as little-endian float32"),
        ({"logprobs": [0.5]}, "logprobs must be numbers packed"),
        ({"num_top": "2"}, "Logprobs.num_top must be int"),
        ({"num_top": -2}, "Logprobs.num_top must be at least 0, got -2"),
        ({"colour": 1}, "Logprobs: unknown fields"),
    ],
)
def test_malformed_logprobs_are_refused(logprobs: dict[str, object], problem: str) -> None:
    fields = {
        "num_top": 0,
        "token_ids": b"",
        "logprobs": b"",
        "top_token_ids": b"",
        "top_logprobs": b"",
        "texts": "",
        "text_lens": b"",
        "token_bytes": b"",
        "byte_lens": b"",
        **logprobs,
    }
    payload = {"v": PROTOCOL_VERSION, "type": "delta", "request_id": "r", "token_ids": b""}
    payload.update(text="", logprobs=fields)
    with pytest.raises(ProtocolError, match=problem):
        decode_to_frontend(msgpack.packb(payload))
