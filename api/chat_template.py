"""The prompt of a chat request: the model's own chat template, or a plain default one.

A model folder whose tokenizer carries a chat template (``chat_template`` in
``tokenizer_config.json``, or ``chat_template.jinja``) renders messages with it, through
transformers: ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``. Its
text already holds the template's special tokens (``<|begin_of_text|>``...), so it is tokenized
without the tokenizer's own special prefix.

A folder without one (the random model of ``kvstore new-model``, a base model) gets the default
template, one message per line::

    {system}                      a system (or developer) message: its text, then a blank line
    User: {content}               a user message
    Assistant:{content}           an assistant message: the generation prompt, then the answer as is
    Assistant:                    the generation prompt, after the last message

``[system "Be brief.", user "Hi", assistant " Hello.", user "And?"]`` renders as
``"Be brief.\\n\\nUser: Hi\\nAssistant: Hello.\\nUser: And?\\nAssistant:"``. An assistant
message follows its ``Assistant:`` with no space added: the model's answer to ``...Assistant:``
is the text that follows it, so a conversation sent back re-renders, and re-tokenizes, to the
very tokens the model read and wrote. The first turn is tokenized with the tokenizer's special
prefix (a BOS token, when it adds one).

A turn on a named session sends only what follows the stored conversation: the
:func:`continuation` of the messages, tokenized without a special prefix.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstore.api.errors import InvalidParameter

__all__ = ["DEFAULT_GENERATION_PROMPT", "continuation", "encode", "first_turn_prefix", "has_chat_template", "render"]

#: What the default template puts after the last message; the answer follows it directly.
DEFAULT_GENERATION_PROMPT = "Assistant:"
_LABELS = {"user": "User: ", "assistant": DEFAULT_GENERATION_PROMPT}
# Stands in for the stored conversation when a named session's request sends only new messages:
# what the template puts between an answer and the next message is rendered the same way.
_EARLIER = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": text}


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template of its own."""
    return bool(getattr(tokenizer, "chat_template", None))


def _default(messages: Sequence[Message], generation_prompt: bool) -> str:
    lines = []
    for message in messages:
        role, content = message["role"], message["content"]
        lines.append(content + "\n" if role == "system" else _LABELS[role] + content)
    if generation_prompt:
        lines.append(DEFAULT_GENERATION_PROMPT)
    return "\n".join(lines)


def render(tokenizer: Any, messages: Sequence[Message], *, generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` (roles ``system``, ``user``, ``assistant``).

    Parameters
    ----------
    tokenizer : the model folder's tokenizer; its chat template when it has one, else the default
    messages : the conversation, oldest first
    generation_prompt : end with what starts the assistant's answer

    Raises
    ------
    InvalidParameter : the model's template refuses the conversation (roles out of the order it
        takes, a system message where it takes none); ``param`` is ``messages``
    """
    if not has_chat_template(tokenizer):
        return _default(messages, generation_prompt)
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja2's TemplateError, or raise_exception() in the template itself
        raise InvalidParameter(
            f"the model's chat template refuses these messages: {exc}", param="messages", code="invalid_messages"
        ) from None
    if not isinstance(text, str):
        raise InvalidParameter("the model's chat template did not render text", param="messages")
    return text


def continuation(tokenizer: Any, messages: Sequence[Message]) -> str:
    """The text of what ``messages`` add to a stored conversation, generation prompt included.

    When the messages hold an assistant message, the stored conversation is everything up to and
    including the last one; the new turn is the text the whole conversation's rendering adds to
    that part's. Without one, every message is new, and the rendering continues an earlier
    exchange.

    Raises
    ------
    InvalidParameter : the template renders the conversation so far differently once more
        messages follow (it rewrites earlier answers), so no continuation exists
    """
    last = max((i for i, message in enumerate(messages) if message["role"] == "assistant"), default=None)
    if last is None:
        earlier, whole = list(_EARLIER), [*_EARLIER, *messages]
    else:
        earlier, whole = list(messages[: last + 1]), list(messages)
    before = render(tokenizer, earlier, generation_prompt=False)
    after = render(tokenizer, whole, generation_prompt=True)
    if not after.startswith(before):
        raise InvalidParameter(
            "the model's chat template renders the earlier messages differently once the new ones follow, so this "
            "turn cannot continue the stored session: send the request without session_id (the stored prefix is "
            "still found and reused)",
            param="session_id",
            code="template_not_continuable",
        )
    return after[len(before) :]


def encode(tokenizer: Any, text: str, *, special_prefix: bool) -> list[int]:
    """Token ids of prompt text; ``special_prefix``: with the tokenizer's special prefix (a BOS).

    A conversation's first turn takes it — unless a chat template already wrote it into the text
    (:func:`first_turn_prefix`); a continuation never does.
    """
    return list(tokenizer(text, add_special_tokens=special_prefix)["input_ids"])


def first_turn_prefix(tokenizer: Any) -> bool:
    """Whether the first turn of a chat is tokenized with the special prefix: only with the default
    template (a model's own template writes its special tokens into the text)."""
    return not has_chat_template(tokenizer)
