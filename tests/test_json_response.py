"""JSON answers: rendered fast, read back as what was sent, always valid JSON."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend.generation import MAX_LOGPROBS_ON_LOOP, json_answer
from frontend.json_response import JSONResponse
from protocol import GenerateRequest, GenerateResult

_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


@given(_JSON_VALUES)
def test_what_is_sent_reads_back_as_itself(value: Any) -> None:
    assert json.loads(JSONResponse(value).body) == value


def test_text_goes_as_utf8_without_spaces_and_no_number_is_nan_or_infinite() -> None:
    body = JSONResponse({"text": "héllo 😀", "logprob": float("nan"), "top": [float("-inf")]}).body
    assert body == '{"text":"héllo 😀","logprob":null,"top":[null]}'.encode()


@pytest.mark.parametrize(
    ("prompt_tokens", "on_the_loop"),
    [(10, True), (MAX_LOGPROBS_ON_LOOP // 21 + 1, False)],  # 20 top logprobs and the token's
)
def test_an_answer_of_many_logprobs_is_built_off_the_event_loop(
    prompt_tokens: int, on_the_loop: bool
) -> None:
    """Built on the loop, 8 choices scoring a 1,020-token prompt held every other
    request and stream about 220 ms (Xeon, loaded)."""
    work = GenerateRequest("r", "p", 0, prompt_logprobs=20, echo=True)
    result = GenerateResult("r", "", [], "length", prompt_tokens, 0, 0.0, 1.0)
    built_on: list[int] = []

    def final(accepted: Any, results: list[GenerateResult]) -> dict[str, Any]:
        built_on.append(threading.get_ident())
        return {"choices": len(results)}

    async def answer() -> tuple[int, bytes]:
        response = await json_answer(work, final, None, [result], None)  # type: ignore[arg-type]
        return threading.get_ident(), bytes(response.body)

    loop_thread, body = asyncio.run(answer())
    assert json.loads(body) == {"choices": 1}
    assert (built_on == [loop_thread]) is on_the_loop
