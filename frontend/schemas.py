"""Request bodies of the HTTP API, validated with pydantic.

JSON types are checked strictly (``"16"`` is not a number), unknown fields are
refused so that a misspelt parameter is not silently ignored, and every error
names the field.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_STRINGS = 4


class GenerateBody(BaseModel):
    """POST /generate."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str | None = Field(
        None, min_length=1, max_length=128, description="echoed back; made up if absent"
    )
    prompt: str = Field(min_length=1, description="the text to continue")
    max_new_tokens: int = Field(16, gt=0, description="at most MAX_NEW_TOKENS_LIMIT")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 keeps the whole vocabulary")
    seed: int | None = Field(None, ge=0, lt=2**63, description="reproducible sampling")
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings; output is cut before them"
    )
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = Field(False, description="send server-sent events as tokens arrive")

    def stop_strings(self) -> list[str]:
        return normalize_stop(self.stop)


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    """One list of stop strings; raises ValueError when there are too many or one is empty."""
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
    if any(not s for s in strings):
        raise ValueError("stop: stop strings must not be empty")
    return strings


def describe(error: ValidationError) -> str:
    """One readable sentence per problem: 'max_new_tokens: Input should be ...'."""
    parts = []
    for item in error.errors(include_url=False):
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)
