"""JSON answers: rendered fast, read back as what was sent, always valid JSON."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from frontend.json_response import JSONResponse

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
