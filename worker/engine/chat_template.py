"""Conversations into prompt text, for /v1/chat/completions and /tokenize.

Three sources, first found wins: the Jinja file CHAT_TEMPLATE names, the
tokenizer's own template (through its `apply_chat_template`), and for a base
model that has none (distilgpt2, `synthetic`) `DEFAULT_CHAT_TEMPLATE`. A
template is rendered the way Hugging Face renders one: transformers' own
sandboxed Jinja renderer, with the tokenizer's special tokens in scope.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from protocol.settings import ConfigError

log = logging.getLogger(__name__)

# Plain text a base model can continue: "User: hi\n\nAssistant:". Role names are
# capitalised; every message ends with a blank line.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

Messages = list[dict[str, str]]


class ChatTemplateError(ValueError):
    """The template refused the conversation (it may raise_exception on, say, a
    role it does not know); the message says why."""


# How a conversation ends: (add_generation_prompt, continue_final_message).
Ending = tuple[bool, bool]


class ChatTemplate:
    def __init__(self, source: str, render: Callable[[Messages, Ending], str]) -> None:
        # For the log: where the template came from (a path, for CHAT_TEMPLATE),
        # which is the operator's to know and no client's.
        self.source = source
        self._render = render

    def render(
        self,
        roles: Sequence[str],
        contents: Sequence[str],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as prompt text, ending with the reply's turn
        (``add_generation_prompt``) or, with ``continue_final_message``, inside the
        last message, with nothing after its content, as transformers renders it."""
        messages = [
            {"role": role, "content": content}
            for role, content in zip(roles, contents, strict=True)
        ]
        try:
            return self._render(messages, (add_generation_prompt, continue_final_message))
        except Exception as exc:  # jinja2 and the template itself raise many types
            raise ChatTemplateError(
                f"messages: the chat template cannot render them: {type(exc).__name__}: {exc}"
            ) from None


def jinja_template(
    template: str, source: str, special_tokens: Mapping[str, str] | None = None
) -> ChatTemplate:
    """A template given as Jinja text, rendered as `apply_chat_template` would."""
    tokens = dict(special_tokens or {})

    def render(messages: Messages, ending: Ending) -> str:
        # transformers' renderer; imported here so that the torch-free fake engine
        # pays for it only when it renders a conversation.
        from transformers.utils import chat_template_utils

        # Annotated as returning str; it returns (rendered chats, generation indices).
        renderer: Any = chat_template_utils.render_jinja_template
        add_generation_prompt, continue_final_message = ending
        rendered, _ = renderer(
            [messages],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **tokens,
        )
        return str(rendered[0])

    return ChatTemplate(source, render)


def choose_chat_template(
    path: str, hf_tokenizer: Any | None, special_tokens: Mapping[str, str]
) -> ChatTemplate:
    """CHAT_TEMPLATE's file, else the tokenizer's own template, else the default.
    Raises ConfigError for a file that cannot render a one-message conversation."""
    if path:
        chosen = _template_file(path, special_tokens)
    elif hf_tokenizer is not None and getattr(hf_tokenizer, "chat_template", None):

        def render(messages: Messages, ending: Ending) -> str:
            add_generation_prompt, continue_final_message = ending
            return str(
                hf_tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
            )

        chosen = ChatTemplate("the tokenizer's own", render)
    else:
        chosen = jinja_template(
            DEFAULT_CHAT_TEMPLATE, "the default: 'Role: content' lines", special_tokens
        )
    log.info("chat template: %s", chosen.source)
    return chosen


def _template_file(path: str, special_tokens: Mapping[str, str]) -> ChatTemplate:
    """CHAT_TEMPLATE's template, tried once at start: one with a syntax error
    would otherwise fail every chat request, each answered as the client's fault."""
    try:
        chosen = jinja_template(Path(path).read_text(encoding="utf-8"), path, special_tokens)
        chosen.render(["user"], ["Hello"], add_generation_prompt=True)
    except (OSError, UnicodeDecodeError, ChatTemplateError) as exc:
        why = str(exc).removeprefix("messages: ")
        raise ConfigError(
            f"CHAT_TEMPLATE={path!r} cannot render a conversation of one user message "
            f"({why}): fix the template, or unset CHAT_TEMPLATE to use the model's own"
        ) from None
    return chosen
