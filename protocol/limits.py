"""The limits on what a request may ask for, enforced on both sides of the wire:
by the frontend's schemas (a 422 naming the field) and again by the worker's own
checks (`worker.serve.validation`), which trust nothing that reaches its socket.
`MAX_CHOICES` is the frontend's alone: the worker sees each choice as a request
of its own."""

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs
MAX_CHAT_MESSAGES = 256  # the codec's longest list
MAX_ROLE_CHARS = 64
MAX_REPETITION_PENALTY = 10.0
MAX_PRESENCE_PENALTY = 2.0  # and frequency: OpenAI's range is [-2, 2]
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API
MAX_LOGIT_BIAS_VALUE = 100.0  # and -100: OpenAI's range
MAX_CHOICES = 8  # OpenAI's n and best_of: worker requests one client request fans out to
