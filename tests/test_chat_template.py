"""Conversations into prompts: the default template, a CHAT_TEMPLATE file, and a
template that refuses a conversation."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol import ErrorCode, GenerateRequest
from protocol.settings import ConfigError
from worker.engine.chat_template import ChatTemplateError, choose_chat_template, jinja_template
from worker.engine.fake_engine import FakeEngine
from worker.engine.interface import RequestRejected

TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def test_the_default_template_writes_role_lines_and_the_reply_turn() -> None:
    template = choose_chat_template("", None, TOKENS)
    prompt = template.render(["system", "user"], ["Be brief.", "Hi"], add_generation_prompt=True)
    assert prompt == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert not template.render(["user"], ["Hi"], add_generation_prompt=False).endswith("Assistant:")


def test_continuing_the_final_message_leaves_it_open() -> None:
    """vLLM's continue_final_message: the reply goes on the last message, so
    nothing the template writes after that message's content is kept."""
    template = choose_chat_template("", None, TOKENS)
    roles, contents = ["user", "assistant"], ["Hi", "The answer is"]
    prompt = template.render(roles, contents, False, continue_final_message=True)
    assert prompt == "User: Hi\n\nAssistant: The answer is"
    closed = template.render(roles, contents, False)
    assert closed == prompt + "\n\n"


def test_a_tokenizers_own_template_continues_the_final_message_too() -> None:
    """The tokenizer's path (`apply_chat_template`), not only the Jinja renderer's."""
    transformers = pytest.importorskip("transformers")
    from worker.model.loader import gpt2_tokenizer

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer())
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    template = choose_chat_template("", tokenizer, TOKENS)
    roles, contents = ["user", "assistant"], ["Hi", "The answer is"]
    opened = template.render(roles, contents, False, continue_final_message=True)
    assert opened == "<|user|>Hi<|end|><|assistant|>The answer is"
    assert template.render(roles, contents, False) == opened + "<|end|>"


def test_a_chat_template_file_is_rendered_as_hugging_face_renders_it(tmp_path: Path) -> None:
    path = tmp_path / "chatml.jinja"
    # trim_blocks and lstrip_blocks (HF's settings) drop the newlines after tags.
    path.write_text(
        "{{ bos_token }}{% for m in messages %}\n"
        "<|{{ m.role }}|>{{ m.content | trim }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    template = choose_chat_template(str(path), None, TOKENS)
    rendered = template.render(["user"], ["  Hi  "], add_generation_prompt=True)
    assert rendered == "<s><|user|>Hi\n<|assistant|>"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
        ("{{ messages[5].content }}", "UndefinedError"),
        (b"\xff\xfe", "utf-8"),
    ],
)
def test_a_chat_template_file_that_cannot_render_is_refused_at_start(
    tmp_path: Path, text: str | bytes, why: str
) -> None:
    """Accepted, it failed every chat request with a 422 that blamed the client."""
    path = tmp_path / "broken.jinja"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=f"CHAT_TEMPLATE='{path}' cannot render") as refused:
        choose_chat_template(str(path), None, TOKENS)
    assert why in str(refused.value)
    assert str(refused.value).endswith("unset CHAT_TEMPLATE to use the model's own")


def test_a_template_that_raises_refuses_the_request_by_name() -> None:
    template = jinja_template(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}",
        "/srv/secret/strict.jinja",
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        template.render(["assistant"], ["x"], add_generation_prompt=True)
    engine = FakeEngine(capacity=1)
    engine.chat_template = template
    chat = GenerateRequest("r", "", 4, chat_roles=["assistant"], chat_contents=["x"])
    with pytest.raises(RequestRejected) as rejected:
        engine.admit([chat])
    assert rejected.value.code == ErrorCode.INVALID_REQUEST
    assert rejected.value.message.startswith("messages: ")
    assert "/srv/secret" not in rejected.value.message  # the server's paths are its own
    assert engine.num_active() == 0


def test_a_conversation_is_the_prompt_the_template_renders() -> None:
    engine = FakeEngine(capacity=1)
    chat = GenerateRequest("r", "", 2, chat_roles=["user"], chat_contents=["Hi"], echo=True)
    engine.admit([chat])
    [finished] = engine.step().finished + engine.step().finished
    assert finished.prompt_text == "User: Hi\n\nAssistant:"
    assert finished.num_prompt_tokens == len("User: Hi\n\nAssistant:")
