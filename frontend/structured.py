"""Structured outputs at the frontend: OpenAI's ``response_format`` and vLLM's
``structured_outputs``, checked and made into the grammar the worker constrains
the output with (`GenerateRequest.grammar`, in llguidance's format).

A grammar is checked as far as it can be without the model's tokenizer, by
llguidance's own validation under the limits the worker compiles it with, so
that a bad schema is a 400 or 422 naming its field before it is queued. A large
schema takes milliseconds to check, so that runs on a thread, never on the event
loop, and the latest results are kept. Only llguidance's compilers run here: no
torch (``llguidance.torch`` is never imported).
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import llguidance

from frontend.body import parse_json
from frontend.ecma_patterns import with_rust_patterns
from frontend.errors import ApiError
from frontend.pattern_escapes import escaped_pattern_problem, schema_patterns
from protocol import GrammarKind
from protocol.grammar_shape import grammar_schemas, grammar_shape_problem
from protocol.json_schema import EXACT_KEYWORDS, subschemas
from protocol.limits import GRAMMAR_LIMITS, MAX_GRAMMAR_CHARS, MAX_GRAMMAR_ERROR_CHARS
from protocol.wire import shorten

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in the type stub only

    from frontend.openai_schemas import ResponseFormat

# JSON as json.dumps writes it, with no other whitespace: a model, above all one
# with random weights, could otherwise pad it without end. A schema's own
# "x-guidance" options override these (llguidance's JSON options), those of
# _GUIDANCE_OPTIONS alone.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# The "x-guidance" options under which llguidance still writes JSON that its
# schema takes: each with its type, and, for a string, what keeps the output
# JSON. The others let it write what the schema refuses (lenient: a keyword it
# lacks is ignored; coerce_one_of: a oneOf followed as anyOf;
# json_allowed_escapes "": const "a\"b" written "ab"), or no JSON at all
# (whitespace_pattern "[a-z]{0,3}" wrote '{toc"a"ans: sol1vyf}', and so did
# separators such as " = "); given their defaults, they change nothing.
_JSON_WHITESPACE = " \t\n\r"
_GuidanceOption = tuple[type, Callable[[str], bool] | None, str]
_GUIDANCE_OPTIONS: dict[str, _GuidanceOption] = {
    "whitespace_flexible": (bool, None, ""),
    "key_separator": (
        str,
        lambda v: v.strip(_JSON_WHITESPACE) == ":",
        'a ":" with JSON whitespace around it at most',
    ),
    "item_separator": (
        str,
        lambda v: v.strip(_JSON_WHITESPACE) == ",",
        'a "," with JSON whitespace around it at most',
    ),
    "json_allow_general_unicode_escapes": (bool, None, ""),
}
# The others llguidance knows, each with its type and the default that changes nothing.
_GUIDANCE_DEFAULTS: dict[str, tuple[type | tuple[type, ...], object]] = {
    "lenient": (bool, False),
    "coerce_one_of": (bool, False),
    "whitespace_pattern": ((str, type(None)), None),
    "json_allowed_escapes": ((str, type(None)), None),
}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# vLLM's one other type: a valid request this server cannot follow (400, where a
# type no server defines is an invalid one, 422).
UNSUPPORTED_RESPONSE_FORMATS = ("structural_tag",)
# vLLM's other structured_outputs fields, and the values this server honours as
# asked: with one grammar engine there is no fallback to disable, and JSON comes
# without free whitespace whichever disable_any_whitespace says (see JSON_OPTIONS).
# Clients that send vLLM's defaults send these.
VLLM_OPTIONS: dict[str, tuple[object, ...]] = {
    "json_object": (None, False, True),
    "disable_fallback": (False, True),
    "disable_any_whitespace": (False, True),
    "disable_additional_properties": (False,),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}
STRUCTURED_OUTPUTS = {
    "json": GrammarKind.JSON,
    "regex": GrammarKind.REGEX,
    "choice": GrammarKind.CHOICE,
    "grammar": GrammarKind.GRAMMAR,
}
JSON_KINDS = (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT, GrammarKind.JSON)
# llguidance reads a schema's numbers as doubles, and integer bounds as 64-bit
# integers, so past 2^53 it follows a neighbour of the integer asked for: enum
# [9007199254740993] allowed ...992, maximum 10^19 refused 10^19. Such schemas
# (floats as large too) are refused rather than followed wrongly.
MAX_EXACT_INTEGER = 2**53
# An object counted elsewhere: one exact value (const, enum), or one whose keys a
# schema it refers to may require or close ($ref, which is not followed here).
_NOT_COUNTED_HERE = frozenset({"const", "enum", "$ref"})
_ALL_OF_BRANCH = re.compile(r"\.allOf\[\d+\]$")

_JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
# llguidance's words for a valid schema it cannot follow: 400 unsupported, not 422.
_UNSUPPORTED = ("Unimplemented", "Unknown format", "min/maxProperties only supported")
# Its refusal of a oneOf, which advises its coerce_one_of: refused here (it would
# follow the oneOf as an anyOf, taking a value that matches two branches).
_ONE_OF_REFUSED = "oneOf constraints are not supported"
_ONE_OF_ADVICE = (
    "a oneOf is followed only where no value can match two of its branches, as "
    "llguidance tells: branches of different types, string consts or enums, or "
    "objects told apart by a property's string const (a tag); make them so, or "
    "use anyOf"
)


@dataclass(frozen=True)
class GrammarSource:
    """What a body asks its output to follow, before it is compiled."""

    kind: str  # a GrammarKind
    value: Any  # a schema (an object, or its JSON text), a regex, choices or a grammar
    param: str  # where it was in the body, for errors


class Grammar(NamedTuple):
    """A request's grammar, compiled: `GenerateRequest`'s ``grammar_kind`` and
    ``grammar``; both empty for unconstrained text."""

    kind: str  # a GrammarKind
    text: str  # in llguidance's format


NO_GRAMMAR = Grammar("", "")


async def request_grammar(
    response_format: ResponseFormat | None, structured_outputs: dict[str, Any] | None
) -> Grammar:
    """The grammar for what the body asks. Raises ApiError naming the field: 422
    for an invalid one, 400 for one this server does not support."""
    source = grammar_source(response_format, structured_outputs)
    if source is None:
        return NO_GRAMMAR
    grammar, problem = await asyncio.to_thread(compile_grammar, source.kind, source.value)
    if problem is not None:
        param = source.param
        if problem.startswith("Unimplemented keys"):  # JSON Schema keywords llguidance lacks
            problem += "; this server cannot follow these keywords: leave them out"
        elif problem.startswith("Invalid type"):
            problem += f"; a type is one of {', '.join(_JSON_TYPES)}"
        elif problem.startswith(_ONE_OF_REFUSED):
            where = problem.partition(" while processing ")[2]  # a oneOf under $defs
            problem = _ONE_OF_ADVICE + (f" (at {where})" if where else "")
        if problem.startswith((*_UNSUPPORTED, _ONE_OF_ADVICE)) or _CANNOT_FOLLOW in problem:
            raise ApiError(400, f"{param}: {problem}", "unsupported", param)
        raise ApiError(422, f"{param}: {problem}", "invalid_request", param)
    return Grammar(source.kind, grammar)


def grammar_source(
    response_format: ResponseFormat | None, structured_outputs: dict[str, Any] | None
) -> GrammarSource | None:
    """Checks the shape of both fields (cheap); None when the output is free."""
    from_format = _response_format(response_format) if response_format is not None else None
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise _invalid(
            "structured_outputs", "send either response_format or structured_outputs, not both"
        )
    return _structured_outputs(structured_outputs)


def _response_format(value: ResponseFormat) -> GrammarSource | None:
    if value.type in UNSUPPORTED_RESPONSE_FORMATS:
        raise ApiError(
            400,
            f"response_format.type: {value.type} is not supported; send one of "
            f"{', '.join(RESPONSE_FORMATS)}, or structured_outputs",
            "unsupported",
            "response_format.type",
        )
    if value.type not in RESPONSE_FORMATS:
        raise _invalid(
            "response_format.type",
            f"must be one of {', '.join(RESPONSE_FORMATS)}, got {_preview(value.type)}",
        )
    if value.type != "json_schema" and value.json_schema is not None:
        raise _invalid(
            "response_format.json_schema",
            f"is for type json_schema, not {value.type}: set type json_schema to follow it",
        )
    if value.type == "text":
        return None
    if value.type == "json_object":
        return GrammarSource(GrammarKind.JSON_OBJECT, {"type": "object"}, "response_format")
    if value.json_schema is None:
        raise _invalid("response_format.json_schema", "must be an object with a schema")
    if value.json_schema.schema_ is None:
        raise _invalid("response_format.json_schema.schema", "must be a JSON Schema object")
    return GrammarSource(
        GrammarKind.JSON_SCHEMA, value.json_schema.schema_, "response_format.json_schema.schema"
    )


def _structured_outputs(value: dict[str, Any]) -> GrammarSource:
    _check_vllm_options(value)
    unknown = [key for key in value if key not in STRUCTURED_OUTPUTS and key not in VLLM_OPTIONS]
    if unknown:
        names = ", ".join(_preview(key) for key in unknown[:5])
        known = [*STRUCTURED_OUTPUTS, *VLLM_OPTIONS]
        meant = difflib.get_close_matches(unknown[0], known, n=1) if len(unknown) == 1 else []
        advice = (
            f"did you mean {meant[0]}?" if meant else f"send one of {', '.join(STRUCTURED_OUTPUTS)}"
        )
        raise ApiError(
            400,
            f"structured_outputs: {names} not supported; {advice}",
            "unsupported",
            "structured_outputs",
        )
    given = [key for key in STRUCTURED_OUTPUTS if value.get(key) is not None]
    if value.get("json_object") is True:  # vLLM's spelling of response_format json_object
        given.append("json_object")
    if len(given) != 1:
        raise _invalid(
            "structured_outputs",
            f"set exactly one of {', '.join(STRUCTURED_OUTPUTS)} (or json_object true), "
            f"got {len(given)}",
        )
    key = given[0]
    if key == "json_object":
        return GrammarSource(GrammarKind.JSON_OBJECT, {"type": "object"}, "structured_outputs")
    item, param = value[key], f"structured_outputs.{key}"
    if key == "json":
        if isinstance(item, str):
            try:
                item = parse_json(item)
            except ValueError as exc:
                raise _invalid(param, f"is not JSON: {exc}") from None
        if not isinstance(item, dict):
            raise _invalid(param, "must be a JSON Schema object, or its JSON text")
    elif key == "choice":
        if not (item and isinstance(item, list) and all(isinstance(c, str) and c for c in item)):
            raise _invalid(param, "must be a list of non-empty strings")
    elif not (isinstance(item, str) and item):
        raise _invalid(param, "must be a non-empty string")
    return GrammarSource(STRUCTURED_OUTPUTS[key], item, param)


def _check_vllm_options(value: dict[str, Any]) -> None:
    """400 for a vLLM option at a value that asks for more than this server does."""
    for key, allowed in VLLM_OPTIONS.items():
        # By identity: 1 == True, and 1 is not a boolean.
        if key in value and not any(value[key] is option for option in allowed):
            shown = " or ".join(json.dumps(option) for option in allowed)
            raise ApiError(
                400,
                f"structured_outputs.{key}: only {shown} is supported here, got "
                f"{_preview(value[key])}",
                "unsupported",
                f"structured_outputs.{key}",
            )


def compile_grammar(kind: str, value: Any) -> tuple[str, str | None]:
    """llguidance's grammar for ``value`` and, if it cannot be used, why (starting
    "Unimplemented", llguidance's word, for what this server cannot follow). Runs
    on a thread: serialising a schema and checking it both take time."""
    try:
        text = (
            value
            if isinstance(value, str)
            else json.dumps(value, ensure_ascii=False, allow_nan=False)
        )
    except ValueError:  # 1e400 in a schema: written out, it would be Infinity, not JSON
        return "", "a number in it is past a float's range (about 1.8e308)"
    if len(text) > MAX_GRAMMAR_CHARS:
        return "", f"{len(text):,} characters; at most {MAX_GRAMMAR_CHARS:,}"
    schema = _as_schema(value) if kind in JSON_KINDS else None
    problem = (
        _guidance_options_problem(schema) or _numbers_problem(schema)
        if kind in JSON_KINDS
        else None
    )
    if problem is not None:
        return "", problem
    if kind == GrammarKind.REGEX and _ends_in_lone_backslash(text):
        # llguidance drops it, and would follow another regex than the one asked for.
        return "", f"invalid regex at offset {len(text) - 1}: incomplete escape sequence"
    if kind in JSON_KINDS and (lone := _lone_backslash_problem(schema)) is not None:
        return "", lone
    compiled = _with_ecma_patterns(kind, schema, text)
    grammar, problem = _checked_grammar(kind, compiled)
    if problem is not None and compiled != text:
        # Refused as rewritten. As sent: where only the rewrite made its grammar too
        # long, followed as Rust reads its patterns, as before; else refused, in the
        # client's own terms where the fault is there too (its own pattern's offset).
        as_sent, own_problem = _checked_grammar(kind, text)
        if problem.startswith(_GRAMMAR_TOO_LONG):
            grammar, problem = as_sent, own_problem
        else:
            problem = own_problem or problem
    if problem is None and kind in JSON_KINDS:  # a schema llguidance takes
        problem = _repeated_keys_problem(schema) or escaped_pattern_problem(schema)
    if problem is None and kind == GrammarKind.GRAMMAR:  # its %json blocks
        problem = next(filter(None, map(_json_block_problem, grammar_schemas(text))), None)
    return ("", problem) if problem is not None else (grammar, None)


def _with_ecma_patterns(kind: str, schema: Any, text: str) -> str:
    """A schema's text with its patterns as ECMAScript means them
    (`frontend.ecma_patterns`); ``text`` itself for any other grammar, or where
    no pattern changes."""
    if kind not in JSON_KINDS or schema is None:
        return text
    rewritten = with_rust_patterns(schema)
    return text if rewritten is schema else json.dumps(rewritten, ensure_ascii=False)


def _as_schema(value: Any) -> Any:
    """A schema given as an object or as its JSON text (None for text that is no
    JSON: llguidance then says why)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return None


def _ends_in_lone_backslash(regex: str) -> bool:
    return (len(regex) - len(regex.rstrip("\\"))) % 2 == 1


def _lone_backslash_problem(schema: Any) -> str | None:
    """A schema pattern that ends in a lone backslash, which llguidance drops, as
    it does a regex's: ``^a\\`` was followed as ``^a``."""
    for _, _, pattern in schema_patterns(schema):
        if _ends_in_lone_backslash(pattern):
            at = len(pattern) - 1
            return (
                f"pattern {_shown(pattern, at)}: invalid regex at offset {at}: "
                "incomplete escape sequence"
            )
    return None


def _json_block_problem(schema: Any) -> str | None:
    """What a Lark grammar's %json block holds that would be followed loosely."""
    return _guidance_options_problem(schema) or escaped_pattern_problem(schema)


def _guidance_options_problem(schema: Any) -> str | None:
    """An "x-guidance" option of ``schema`` under which llguidance would not
    write the JSON the schema takes (see _GUIDANCE_OPTIONS)."""
    options = schema.get("x-guidance") if isinstance(schema, dict) else None
    if options is None:
        return None
    if not isinstance(options, dict):
        return (
            f"x-guidance: must be an object of llguidance's JSON options, got {_preview(options)}"
        )
    for name, option in options.items():
        if name in _GUIDANCE_DEFAULTS:
            kinds, default = _GUIDANCE_DEFAULTS[name]
            if not isinstance(option, kinds):
                return f"x-guidance.{name}: must be {_type_names(kinds)}, got {_preview(option)}"
            if option is default:
                continue
        if name not in _GUIDANCE_OPTIONS:
            return (
                f"Unimplemented: x-guidance.{name} is not followed here: the output must be JSON "
                f"that the schema takes; leave it out (the options taken are "
                f"{', '.join(_GUIDANCE_OPTIONS)})"
            )
        kind, keeps_json, what = _GUIDANCE_OPTIONS[name]
        if not isinstance(option, kind):
            return f"x-guidance.{name}: must be {_type_names(kind)}, got {_preview(option)}"
        if isinstance(option, str) and keeps_json is not None and not keeps_json(option):
            return (
                f"Unimplemented: x-guidance.{name} must be {what}, so that the output is JSON; "
                f"got {_preview(option)}"
            )
    return None


def _type_names(kinds: type | tuple[type, ...]) -> str:
    names = {bool: "true or false", str: "a string", type(None): "null"}
    return " or ".join(names[kind] for kind in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _numbers_problem(schema: Any) -> str | None:
    """What llguidance would silently follow otherwise than a schema asks, in the
    numbers that bound or name values: one past ±2^53, a multipleOf that is not
    above 0 (JSON Schema's rule; llguidance takes its absolute value), and draft
    4's boolean exclusiveMinimum and exclusiveMaximum (which it ignores)."""
    for where, key, item in _exact_keywords(schema, ""):
        at = where.lstrip(".")
        if key == "multipleOf" and _is_number(item) and item <= 0:
            return f"{at}: must be greater than 0, got {_preview(item)}"
        if key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(item, bool):
            return (
                f"Unimplemented: {at} is {json.dumps(item)}, draft 4's form, which is not "
                "followed here; give the bound itself as a number (JSON Schema 2020-12)"
            )
        found = next(((at, n) for at, n in _numbers(item, where) if _is_past_doubles(n)), None)
        if found is not None:
            return (
                f"Unimplemented: {found[0].lstrip('.')} holds {_preview(found[1])}, past ±2^53 "
                f"({MAX_EXACT_INTEGER}), where JSON Schema bounds, enum and const cannot "
                "be followed exactly here; ask for a string with a pattern instead"
            )
    return None


def _repeated_keys_problem(schema: Any) -> str | None:
    """A minProperties that an object could meet by writing one key twice:
    llguidance keeps apart only the keys listed in properties, and the parsed
    object has fewer properties than the text wrote."""
    for where, subschema in subschemas(schema, ""):
        if _ALL_OF_BRANCH.search(where):
            continue  # an allOf branch is counted with its siblings, by its parent
        minimum = max(
            (
                branch.get("minProperties", 0)
                for branch in [subschema, *_branches(subschema, "allOf")]
                if _is_number(branch.get("minProperties", 0))
            ),
            default=0,
        )
        if _NOT_COUNTED_HERE & subschema.keys() or not _may_be_object(subschema):
            continue
        num_required, is_closed = _required_and_closed(subschema)
        # The required keys are written once each, and at least one other key
        # if the count asks for more: a repeat matters from one more than that.
        if not is_closed and minimum > num_required + 1:
            return (
                f"Unimplemented: {where.lstrip('.') or 'the schema'} asks for at least "
                f"{_preview(minimum)} properties, with keys not listed in properties, which "
                "the output could repeat to reach the count; list the properties, require "
                "them, and set additionalProperties to false"
            )
    return None


def _required_and_closed(schema: dict[str, Any]) -> tuple[int, bool]:
    """How many keys an object of ``schema`` must hold, and whether it may hold
    none but those listed: its own, with what its allOf branches add, and the
    least that any of its anyOf (or oneOf) branches asks."""
    names, is_closed = _own_required_and_closed(schema)
    for branch in _branches(schema, "allOf"):
        branch_names, branch_closed = _own_required_and_closed(branch)
        names |= branch_names
        is_closed = is_closed or branch_closed
    num_required = len(names)
    for key in ("anyOf", "oneOf"):
        branches = [_own_required_and_closed(branch) for branch in _branches(schema, key)]
        if branches:  # one of them holds; with both keywords, one of each
            least = min(len(names | branch_names) for branch_names, _ in branches)
            num_required = max(num_required, least)
            is_closed = is_closed or all(closed for _, closed in branches)
    return num_required, is_closed


def _own_required_and_closed(schema: dict[str, Any]) -> tuple[set[str], bool]:
    required = schema.get("required")
    names = (
        {name for name in required if isinstance(name, str)}
        if isinstance(required, list)
        else set()
    )
    is_closed = not schema.get("patternProperties") and schema.get("additionalProperties") is False
    return names, is_closed


def _branches(schema: dict[str, Any], key: str) -> list[dict[str, Any]]:
    branches = schema.get(key)
    return [b for b in branches if isinstance(b, dict)] if isinstance(branches, list) else []


def _may_be_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type", "object")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_past_doubles(number: int | float) -> bool:
    """An integer past 2^53, or a float as large: 9007199254740993.0 is parsed as
    ...992.0 before anything here sees it."""
    if isinstance(number, float):
        return abs(number) >= MAX_EXACT_INTEGER
    return abs(number) > MAX_EXACT_INTEGER


def _exact_keywords(schema: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """Each keyword of ``schema`` that asks for a number exactly (a bound, enum or
    const), with where it is and its value."""
    for where, subschema in subschemas(schema, path):
        for key, item in subschema.items():
            if key in EXACT_KEYWORDS:
                yield f"{where}.{key}", key, item


def _numbers(value: Any, path: str) -> Iterator[tuple[str, int | float]]:
    """Each number anywhere in ``value``, a JSON value, with where it is."""
    if _is_number(value):
        yield path, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")


_GRAMMAR_TOO_LONG = "its grammar is "


@functools.lru_cache(maxsize=256)
def _checked_grammar(kind: str, text: str) -> tuple[str, str | None]:
    try:
        if kind in JSON_KINDS:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == GrammarKind.REGEX:
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == GrammarKind.CHOICE:  # a JSON list of strings
            grammar = llguidance.LLMatcher.grammar_from_regex(_any_of(json.loads(text)))
        else:  # Lark, or GBNF made into Lark
            grammar = llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        return "", _short(str(exc))
    if len(grammar) > MAX_GRAMMAR_CHARS:
        return "", f"{_GRAMMAR_TOO_LONG}{len(grammar):,} characters; at most {MAX_GRAMMAR_CHARS:,}"
    if (shape_problem := grammar_shape_problem(grammar)) is not None:
        return "", shape_problem
    limits = llguidance.LLParserLimits(**GRAMMAR_LIMITS, verbose_errors=False)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=limits
    )
    if not is_error:
        return grammar, None
    # The client's regexes, to place a fault in as written (a grammar's own
    # /.../ terminals are quoted as llguidance reads them).
    if kind == GrammarKind.REGEX:
        written = [text]
    else:
        schemas = [json.loads(text)] if kind in JSON_KINDS else grammar_schemas(text)
        written = [pattern for schema in schemas for *_, pattern in schema_patterns(schema)]
    if (regex := _regex_problem(messages[0], written)) is not None:
        pattern, problem = regex
        return "", problem if kind == GrammarKind.REGEX else f"pattern {pattern}: {problem}"
    if (digits := _MULTIPLE_OF_DIGITS.search(messages[0])) is not None:
        return "", (
            "multipleOf: llguidance follows a multipleOf as an integer of at most 10 digits "
            f"times a power of ten, and read one here as {digits.group(1)} (a float's "
            "rounding can add digits: 1.2345e-06 reads as 12344999999999998); use one with "
            "fewer significant digits, or leave it out and check the value yourself"
        )
    return "", _short(messages[0])


_MULTIPLE_OF_DIGITS = re.compile(r"Value for 'multipleOf' has too many digits: (\d+)")


# llguidance's complaint about a regex (a pattern of a schema's too) quotes the
# regex with carets under the fault; for a regex of its own, then the Lark rule
# it wrapped it in ("start: /(/"), which the client never wrote.
_REGEX_ERROR = re.compile(r"regex parse error:\n    (.*)\n    ( *)\^+\nerror: ([^\n]+)")
_ECMA_NAMED_BACKREFERENCE = re.compile(r"\\k<[^>]+>")


# Its complaint about a construct it does not follow: "lookarounds not supported
# yet; WordUnicode in regex /\\bfoo\\b/" (then, for a regex, the Lark rule again).
_REGEX_UNSUPPORTED = re.compile(r"\w[^;:\n]*not supported yet; (\w+) in regex /(.*)/")
# Its names for them (regex-syntax's `Look`), in the regex's own terms.
_ASSERTIONS = {
    "WordUnicode": "\\b, a word boundary",
    "WordUnicodeNegate": "\\B",
    "WordAscii": "\\b, a word boundary",
    "WordAsciiNegate": "\\B",
    "Start": "^ where it does not begin the regex",
    "End": "$ where it does not end the regex",
    "StartLF": "^ in multi-line mode, (?m)",
    "EndLF": "$ in multi-line mode, (?m)",
    "StartCRLF": "^ in multi-line mode, (?mR)",
    "EndCRLF": "$ in multi-line mode, (?mR)",
}
# A valid regex with a construct llguidance does not follow (look-around, a
# backreference, a word boundary) is the server's limit: 400 unsupported.
_CANNOT_FOLLOW = "valid, but this server cannot follow it: "


def _regex_problem(message: str, written: list[str]) -> tuple[str, str] | None:
    """The regex llguidance complains of, and what is wrong with it in its own
    terms, at offsets in the one of ``written`` (the client's regexes) it quotes;
    None for a complaint about no regex."""
    if (found := _REGEX_ERROR.search(message)) is not None:
        quoted, carets, error = found.groups()
        regex = next((r for r in written if _as_quoted(r) == quoted), _unquoted(quoted))
        offset = _offset_in(regex, len(carets))
        shown = _shown(regex, offset)
        if "not supported" in error:  # regex-syntax's words for what it parses and refuses
            return shown, f"{_CANNOT_FOLLOW}{error} (at offset {offset})"
        # ECMAScript's, which regex-syntax does not know: a schema's patterns are its.
        if _ECMA_NAMED_BACKREFERENCE.match(regex, offset):
            return shown, f"{_CANNOT_FOLLOW}backreferences are not supported (at offset {offset})"
        # In a class, or as a range's boundary there: regex-syntax's two errors for it.
        if regex.startswith("\\b", offset) and ("character class" in error or "range" in error):
            return shown, (
                f"{_CANNOT_FOLLOW}\\b in a character class, ECMAScript's backspace (at offset "
                f"{offset}): write \\x08"
            )
        return shown, f"invalid regex at offset {offset}: {error}"
    if (unsupported := _REGEX_UNSUPPORTED.search(message)) is not None:
        construct, quoted = unsupported.groups()
        regex = next((r for r in written if _as_quoted(r) == quoted), _unquoted(quoted))
        what = _ASSERTIONS.get(construct, f"an assertion ({construct})")
        problem = f"{_CANNOT_FOLLOW}{what}: no look-around or anchor inside it is followed"
        return _shown(regex), problem
    return None


# llguidance writes a regex in a Lark rule, /.../, with each / in it as \/, and
# quotes it with a newline, a tab or a carriage return as \n, \t or \r.
_QUOTED_SLASH = "\\/"
_QUOTED_CHARS = {"/": _QUOTED_SLASH, "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _quoted_char(regex: str, i: int) -> str:
    if regex[i] == "/" and i > 0 and regex[i - 1] == "\\":
        return "/"  # escaped already
    return _QUOTED_CHARS.get(regex[i], regex[i])


def _unquoted(quoted: str) -> str:
    """A quoted regex none of the client's matches, as near as can be told: its
    slashes as written (a \\n stays two characters: it may be the regex's own)."""
    return quoted.replace(_QUOTED_SLASH, "/")


# Of a client's regex quoted in a message, at most: a 30,000-character pattern was
# quoted whole, to the client and to the log.
_SHOWN_CHARS = 120


def _shown(regex: str, at: int = 0) -> str:
    """The client's regex for a message: its newlines, tabs and returns escaped;
    a long one cut to the characters around offset ``at`` (its fault), with
    "..." where it was cut."""
    start = max(0, min(at - _SHOWN_CHARS // 2, len(regex) - _SHOWN_CHARS))
    part = regex[start : start + _SHOWN_CHARS]
    shown = "".join(_QUOTED_CHARS[c] if c in "\n\t\r" else c for c in part)
    return ("..." if start else "") + shown + ("..." if start + len(part) < len(regex) else "")


def _as_quoted(regex: str) -> str:
    return "".join(_quoted_char(regex, i) for i in range(len(regex)))


def _offset_in(regex: str, quoted_offset: int) -> int:
    """Where in ``regex`` the character at ``quoted_offset`` of its quote is."""
    position = 0
    for i in range(len(regex)):
        position += len(_quoted_char(regex, i))
        if position > quoted_offset:
            return i
    return len(regex)


# What llguidance's regex syntax (Rust's) gives a meaning; escaped, each stands for itself.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _any_of(choices: list[str]) -> str:
    """A regex that matches exactly one of ``choices``. One lexeme, so that the
    list may be long: as Lark alternatives (llguidance's "choice"), a list of
    more than GRAMMAR_LIMITS' max_items_in_row would fail to parse."""
    return "|".join(
        "".join(f"\\{c}" if c in _REGEX_META else c for c in choice) for choice in choices
    )


def _invalid(param: str, message: str) -> ApiError:
    """422 naming the field at fault by its whole path: response_format.json_schema."""
    return ApiError(422, f"{param}: {message}", "invalid_request", param)


def _preview(value: Any) -> str:
    """``value`` in JSON's notation (a number past float range shows as Infinity), cut short."""
    return shorten(json.dumps(value, ensure_ascii=False), 40)


def _short(message: str) -> str:
    return shorten(" ".join(message.split()), MAX_GRAMMAR_ERROR_CHARS)
