"""Request bodies of the OpenAI-compatible endpoints, with vLLM's extensions.

What the completions and chat bodies share is `OpenAIBody`. A parameter this
server cannot honour is accepted at its neutral value only (`unsupported` says
why otherwise: 400); a field no body defines is ignored and named
(`frontend.openai_common`), unless STRICT_REQUEST_FIELDS is set.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from frontend.field_errors import short_name
from frontend.schemas import (
    STRICT,
    CacheSalt,
    MinP,
    RequestBody,
    Seed,
    StopStrings,
    StopTokenIds,
    Temperature,
    TokenIds,
    TopP,
)
from protocol.limits import (
    CHAT_ROLES,
    MAX_CHAT_MESSAGES,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_PRESENCE_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOKEN_ID,
    MAX_TOP_K,
)
from protocol.request_checks import CONTINUE_WITHOUT_GENERATION_PROMPT

Penalty = Annotated[float, Field(ge=-MAX_PRESENCE_PENALTY, le=MAX_PRESENCE_PENALTY)]

# A token id as a JSON key: a decimal integer, one spelling per id.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")


def _count_logit_bias(value: Any) -> Any:
    """Counted before pydantic reads an entry: a body of entries is one error."""
    if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS:
        raise PydanticCustomError(
            "logit_bias_size",
            "at most {limit} entries, got {num_entries}",
            {"limit": MAX_LOGIT_BIAS, "num_entries": len(value)},
        )
    return value


def _check_logit_bias_keys(value: dict[str, float]) -> dict[str, float]:
    for key in value:
        if _TOKEN_ID_KEY.fullmatch(key) is None or int(key) > MAX_TOKEN_ID:
            raise PydanticCustomError(
                "logit_bias_key",
                "keys must be token ids, decimal integers 0 to {limit}; got '{key}'",
                {"limit": MAX_TOKEN_ID, "key": short_name(key)},
            )
    return value


# OpenAI's logit_bias: {token id: bias}. The worker, which knows the vocabulary,
# checks the ids against it.
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]],
    BeforeValidator(_count_logit_bias),
    AfterValidator(_check_logit_bias_keys),
    # What the validators check, for /openapi.json (all but the largest id).
    Field(
        json_schema_extra={
            "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": f"^(?:{_TOKEN_ID_KEY.pattern})$"},
        }
    ),
]


NOT_EMPTY_TEXT = {"minLength": 1}
NOT_EMPTY_LIST = {"minItems": 1}
ONE_ITEM = {"minItems": 1, "maxItems": 1}


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = Field(False, description="a last chunk with usage")
    continuous_usage_stats: bool | None = Field(
        False, description="with include_usage, usage so far in every chunk (vLLM)"
    )


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = STRICT

    name: str | None = Field(None, max_length=64, description="the schema's name")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="the JSON Schema the output follows"
    )
    strict: bool | None = Field(None, description="always followed strictly here")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = STRICT

    # Any other is refused by name (400), by `frontend.structured`.
    type: str = Field(
        description="text, json_object or json_schema",
        json_schema_extra={"enum": ["text", "json_object", "json_schema"]},
    )
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")


_GUIDED = "vLLM's older spelling, refused (400): send structured_outputs instead"
_NOT_FOLLOWED = "vLLM's; refused (400) unless it asks for what this server does anyway"

# vLLM's fields that change what is generated, which this server does not follow:
# each with the values that ask for what it does anyway, and what to do instead.
# Ignored as unknown fields, they answered with what the client had ruled out (a
# banned word, a token outside the allowed ones) or left out what it asked for.
_VLLM_NOT_FOLLOWED: dict[str, tuple[tuple[Any, ...], str]] = {
    # An empty list allows no token (vLLM refuses it): not "no restriction".
    "allowed_token_ids": ((None,), "constrain the text with structured_outputs instead"),
    "bad_words": ((None, []), "ban tokens with a logit_bias of -100 instead"),
    "include_stop_str_in_output": (
        (None, False),
        "the text ends before a stop string; add it back yourself",
    ),
    "use_beam_search": ((None, False), "sampling and best_of are what is offered"),
    "truncate_prompt_tokens": ((None,), "send a prompt that fits the context window"),
    "prompt_logprobs": ((None,), "ask for echo with logprobs to score the prompt"),
}


class OpenAIBody(RequestBody):
    """Fields both OpenAI endpoints take."""

    model_config = STRICT

    model: str = Field(min_length=1, description="the served model, as GET /v1/models names it")
    temperature: Temperature | None = Field(1.0, description="0 is greedy")
    top_p: TopP | None = 1.0
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="-1 or 0: off")
    min_p: MinP | None = Field(
        0.0, description="drop tokens less likely than min_p times the likeliest"
    )
    seed: Seed | None = None
    stop: StopStrings = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(
        0, ge=0, description="no EOS, stop id or stop string ends the output before this"
    )
    repetition_penalty: float | None = Field(
        1.0, gt=0.0, le=MAX_REPETITION_PENALTY, description="1 is off; over prompt and output"
    )
    presence_penalty: Penalty | None = Field(0.0, description="0 is off; over the output")
    frequency_penalty: Penalty | None = Field(0.0, description="0 is off; over the output")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(
        1, ge=1, le=MAX_CHOICES, description=f"choices to generate, 1 to {MAX_CHOICES}"
    )
    logit_bias: LogitBias | None = Field(
        None,
        description=f"{{token id: bias}}, at most {MAX_LOGIT_BIAS} entries, each bias in "
        f"[-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], added to its logit",
    )
    user: str | None = Field(None, description="accepted and ignored")
    cache_salt: CacheSalt | None = None
    response_format: ResponseFormat | None = Field(
        None,
        description="OpenAI's: {type: text}, {type: json_object}, or {type: json_schema, "
        "json_schema: {name, schema, strict}}: the output follows the schema",
    )
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's: exactly one of json (a schema, or its text), regex, choice "
        "(a list of strings) or grammar (Lark or GBNF)",
    )

    # vLLM's older spellings of structured_outputs: ignored as unknown fields, they
    # would answer free text to a client that asked for a constraint.
    guided_json: Any = Field(None, description=_GUIDED, json_schema_extra={"type": "null"})
    guided_regex: Any = Field(None, description=_GUIDED, json_schema_extra={"type": "null"})
    guided_choice: Any = Field(None, description=_GUIDED, json_schema_extra={"type": "null"})
    guided_grammar: Any = Field(None, description=_GUIDED, json_schema_extra={"type": "null"})

    allowed_token_ids: Any = Field(
        None, description=_NOT_FOLLOWED, json_schema_extra={"type": "null"}
    )
    bad_words: Any = Field(None, description=_NOT_FOLLOWED, json_schema_extra={"maxItems": 0})
    include_stop_str_in_output: Any = Field(
        None, description=_NOT_FOLLOWED, json_schema_extra={"enum": [None, False]}
    )
    use_beam_search: Any = Field(
        None, description=_NOT_FOLLOWED, json_schema_extra={"enum": [None, False]}
    )
    truncate_prompt_tokens: Any = Field(
        None, description=_NOT_FOLLOWED, json_schema_extra={"type": "null"}
    )
    prompt_logprobs: Any = Field(
        None, description=_NOT_FOLLOWED, json_schema_extra={"type": "null"}
    )

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        """Usage chunks of a stream that is not asked for: an invalid request, as
        OpenAI and vLLM refuse it, not options silently dropped."""
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("needs_stream", "set stream to true to use it")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        """The first parameter set to a value this server cannot honour, with why."""
        for param, is_ok, message in self._checks():
            if not is_ok:
                return param, f"{param}: {message}"
        return None

    def _checks(self) -> list[tuple[str, bool, str]]:
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        guided_checks = [
            (
                f"guided_{kind}",
                value is None,
                f"vLLM's older field, not taken here: send structured_outputs "
                f'{{"{kind}": ...}} instead',
            )
            for kind, value in guided.items()
        ]
        return guided_checks + [
            (
                name,
                _is_one_of(getattr(self, name), followed),
                f"vLLM's, not followed here (only {' or '.join(map(_as_json, followed))}): "
                f"{instead}",
            )
            for name, (followed, instead) in _VLLM_NOT_FOLLOWED.items()
        ]


def _is_one_of(value: Any, values: tuple[Any, ...]) -> bool:
    """``value`` is one of ``values`` as JSON compares them (false is not 0)."""
    return any(type(value) is type(each) and value == each for each in values)


def _as_json(value: Any) -> str:
    return json.dumps(value)


class CompletionBody(OpenAIBody):
    """POST /v1/completions, as OpenAI defines it, with vLLM's extensions."""

    # Each form is described non-empty, and a list of prompts as holding one, as
    # `openai_api._one_prompt` takes them: it refuses the others by name (an empty
    # prompt, 422; a batch, 400), in words pydantic's union errors would not find.
    prompt: (
        Annotated[str, Field(json_schema_extra=NOT_EMPTY_TEXT)]
        | Annotated[TokenIds, Field(json_schema_extra=NOT_EMPTY_LIST)]
        | Annotated[
            list[Annotated[str, Field(json_schema_extra=NOT_EMPTY_TEXT)]],
            Field(fail_fast=True, json_schema_extra=ONE_ITEM),
        ]
        | Annotated[
            list[Annotated[TokenIds, Field(json_schema_extra=NOT_EMPTY_LIST)]],
            Field(fail_fast=True, json_schema_extra=ONE_ITEM),
        ]
    ) = Field(description="text, or token ids; one prompt per request")
    # Its least value depends on echo: `openai_api.completions` refuses what is below
    # it in one message (pydantic's own, "at least 0", misled without echo).
    max_tokens: int | None = Field(
        16,
        description="0 to MAX_NEW_TOKENS_LIMIT; 0 only with echo",
        json_schema_extra={"minimum": 0},
    )
    echo: bool | None = Field(False, description="the prompt before the completion")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="the likeliest tokens to list per token"
    )
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_CHOICES,
        description="generate this many (at least n) and answer the n likeliest; not with stream",
    )
    suffix: str | None = Field(
        None, description="not supported: only null or empty", json_schema_extra={"maxLength": 0}
    )

    def _checks(self) -> list[tuple[str, bool, str]]:
        return [
            *super()._checks(),
            (
                "suffix",
                not self.suffix,
                'text after the completion is not supported; send null or ""',
            ),
        ]


def _check_role(value: str) -> str:
    if value not in CHAT_ROLES:
        raise PydanticCustomError(
            "chat_role",
            "{role} is not one of {roles}",  # pydantic's templates know no !r
            {"role": repr(value[:64]), "roles": ", ".join(CHAT_ROLES)},
        )
    return value


class ContentPart(BaseModel):
    """One part of a message's content, as OpenAI defines them. Only text is
    served: a part of another type (an image, audio, a file) is refused by name
    (400, `frontend.chat_api`). Any other field is unknown, as a message's are."""

    model_config = STRICT

    type: str = Field(description="text; image_url, input_audio, file and refusal are refused")
    text: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None
    refusal: str | None = None


class ChatMessage(BaseModel):
    """One message: its role and content, and the other fields OpenAI defines for
    a message, taken and not used, so that a valid conversation passes
    STRICT_REQUEST_FIELDS. Any other field is unknown: ignored and named as the
    body's own are, or refused with STRICT_REQUEST_FIELDS."""

    model_config = STRICT

    role: Annotated[str, AfterValidator(_check_role)] = Field(
        json_schema_extra={"enum": list(CHAT_ROLES)}
    )
    content: str | list[ContentPart] | None = Field(
        None, description="text, or a list of {type: text, text} parts"
    )
    name: str | None = Field(None, description="accepted and not used")
    tool_call_id: str | None = Field(None, description="accepted and not used")
    tool_calls: list[Any] | None = Field(None, description="accepted and not used")
    # An assistant's, as OpenAI's answers carry them back (refusal: null).
    refusal: str | None = Field(None, description="accepted and not used")
    audio: dict[str, Any] | None = Field(None, description="accepted and not used")
    function_call: dict[str, Any] | None = Field(None, description="accepted and not used")


class ChatBody(OpenAIBody):
    """POST /v1/chat/completions, as OpenAI defines it, with vLLM's extensions."""

    messages: list[ChatMessage] = Field(
        min_length=1, max_length=MAX_CHAT_MESSAGES, description="the conversation so far"
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="1 to MAX_NEW_TOKENS_LIMIT; by default as many as fit"
    )
    max_tokens: int | None = Field(None, ge=1, description="the older name of the above")
    logprobs: bool | None = Field(False, description="each output token's logprob")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="with logprobs, the likeliest tokens to list"
    )
    add_generation_prompt: bool | None = Field(
        True, description="end the prompt with the assistant's turn (vLLM)"
    )
    continue_final_message: bool | None = Field(
        False,
        description="the reply goes on the last message, as its continuation (vLLM); "
        "with add_generation_prompt false",
    )
    tools: list[Any] | None = Field(
        None, description="not supported: only empty", json_schema_extra={"maxItems": 0}
    )
    tool_choice: Any = Field(
        None, description="only none", json_schema_extra={"enum": [None, "none"]}
    )

    def _checks(self) -> list[tuple[str, bool, str]]:
        return [
            *super()._checks(),
            ("tools", not self.tools, "tool calling is not supported; leave tools out"),
            (
                "tool_choice",
                self.tool_choice in (None, "none"),
                'tool calling is not supported; leave tool_choice out, or send "none"',
            ),
        ]

    @field_validator("continue_final_message")
    @classmethod
    def _not_a_new_turn(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        """vLLM's rule, an invalid request: the reply cannot both go on the last
        message and start a turn of its own."""
        if value and info.data.get("add_generation_prompt") is not False:
            raise PydanticCustomError(
                "continue_needs_no_generation_prompt", CONTINUE_WITHOUT_GENERATION_PROMPT
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        """An invalid request (422), not an unsupported one: OpenAI's rule."""
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("needs_logprobs", "set logprobs to true to use it")
        return value
