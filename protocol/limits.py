"""The limits on what a request may ask for, enforced on both sides of the wire:
by the frontend's schemas (a 422 naming the field, before the request waits for a
slot) and again by the worker's own checks (`protocol.request_checks`, run by
`worker.serve.peers`), which trust nothing that reaches its socket.
`MAX_CHOICES` is the frontend's alone: the worker sees each choice as a request
of its own."""

from typing import TypedDict

from protocol.wire import MAX_LIST_ITEMS

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_TEMPERATURE = 2.0  # as OpenAI's API
MAX_TOP_K = 2**31 - 1
MIN_SEED = -(2**63)  # a signed 64-bit seed, as vLLM takes it
UNSEEDED = -1  # vLLM's (and llama.cpp's) seed for none: every draw random
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs
MAX_CHAT_MESSAGES = MAX_LIST_ITEMS  # the codec's longest list
# OpenAI's roles. Any other would go into the chat template as it came, where a
# role such as "system\n\nAssistant: sure" writes a turn of its own.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_REPETITION_PENALTY = 10.0
MAX_PRESENCE_PENALTY = 2.0  # and frequency: OpenAI's range is [-2, 2]
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API
MAX_LOGIT_BIAS_VALUE = 100.0  # and -100: OpenAI's range
MAX_CHOICES = 8  # OpenAI's n and best_of: worker requests one client request fans out to
MAX_CACHE_SALT_CHARS = 256  # a tenant's name or a hash of it (vLLM's cache_salt)

# A request's grammar (structured outputs): the schema, regex, choices or
# grammar as sent, and llguidance's grammar made from it, at most this long.
# Compiling one this long takes up to ~0.1 s; compiling runs off the engine loop.
MAX_GRAMMAR_CHARS = 32 * 1024
# patternProperties regexes in a grammar's schema, in all (`protocol.grammar_shape`):
# checking one object's took 2 ms for 32 and 18 ms for 64 on a Xeon (family 6 model 167),
# 0.11 s for 32 regexes of nested counted repeats on a Zen 4 (family 25 model 17).
MAX_PATTERN_PROPERTIES = 32
# Of llguidance's complaint about a grammar, quoted back to the client by either side.
MAX_GRAMMAR_ERROR_CHARS = 300

# The smallest MAX_MESSAGE_BYTES a worker takes, and says in its hello. A
# request's fields besides its prompt (and the token ids a context window bounds)
# take up to ~140 KiB at the protocol's limits: a grammar of MAX_GRAMMAR_CHARS
# 4-byte characters, 4 stop strings, 300 logit biases, 256 chat roles. This
# leaves 100 KiB and more for the prompt, so that a request too large is so for
# its prompt, as the frontend's 422 says.
MIN_MESSAGE_BYTES = 256 * 1024


# llguidance's parser limits (`LLParserLimits`), the same on both sides: what
# building a grammar's lexer and parser, and each step's mask, may cost before
# the grammar is refused. Its defaults, except the grammar's size and the lexer's
# states (each ~2 kB): a grammar too large for these is too large for a request;
# and a step's parser items, whose cost grows faster than their number: an
# ambiguous rule (`x: x x`) reached the default 50,000 after ~150 tokens and
# took 2 s a step on the way, every row of the batch waiting on it. Every
# schema, regex and grammar of the tests needs under 2,000. And the lexer's
# fuel at compile: the expressions it builds stay with the compiled grammar,
# which the worker keeps, ~170 bytes a unit of fuel; at the default 1,000,000 a
# regex of nested repeats (`((-{100}){100}){100}`, 21 characters) held 160 MB.
class GrammarLimits(TypedDict):
    max_items_in_row: int
    initial_lexer_fuel: int
    step_lexer_fuel: int
    step_max_items: int
    max_lexer_states: int
    max_grammar_size: int


GRAMMAR_LIMITS: GrammarLimits = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 200_000,  # ~35 MB at most; 150 patterned properties: 6 ms (Zen 4)
    "step_lexer_fuel": 200_000,  # ~15 ms a step
    "step_max_items": 5_000,  # ~3 ms a step, at worst
    "max_lexer_states": 20_000,
    "max_grammar_size": 100_000,
}
