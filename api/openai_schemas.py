"""Request and response bodies of the OpenAI-compatible routes (``kvstore.api.routers.openai``).

The requests take the fields of OpenAI's Chat Completions and Completions APIs this service
implements, with the same names, types and ranges; two extensions, ``session_id`` and ``top_k``.
A field of OpenAI's API that would change the answer and is not implemented (``logprobs``,
``tools``, penalties, ...) is declared too, so that :meth:`ChatCompletionRequest.refuse_unsupported`
refuses it by name when it is set to anything but its neutral value; any other field is refused
as unknown. Both are 400 ``invalid_request_error`` with ``param`` naming the field: an answer
computed without a parameter the client set would look right and be wrong.

Validation is strict (``{"max_tokens": "16"}`` or ``true`` for a number is refused, never
coerced), as for the rest of the service (``kvstore.api.schemas.Strict``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvstore.api.errors import InvalidParameter
from kvstore.api.schemas import TOKENS_BODY_BYTES, check_token_ids, only_integers

__all__ = [
    "ChatCompletion",
    "ChatCompletionRequest",
    "ChatMessage",
    "Completion",
    "CompletionRequest",
    "ModelCard",
    "ModelList",
    "OpenAIErrorBody",
    "StreamOptions",
    "Usage",
]

MAX_STOP_STRINGS = 4
SEED_MAX = 2**63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    #: the largest JSON body of this model a route reads (413 past it; ``--max-body`` if smaller)
    max_body_bytes: ClassVar[int] = TOKENS_BODY_BYTES


def _unsupported(param: str, what: str) -> InvalidParameter:
    return InvalidParameter(
        f"{param}: {what} is not supported by this server; leave '{param}' out", param, "unsupported_parameter"
    )


# ---------------------------------------------------------------------------- messages
class ContentPart(BaseModel):
    """One part of a message's content: only ``{"type": "text", "text": ...}`` is read."""

    # other part types (images, audio, files) carry other fields: they are refused by type, by name
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="system (developer is read as system), user or assistant; tool and function are refused"
    )
    content: str | list[ContentPart] | None = Field(
        default=None, description="text, or a list of text parts (joined as they are)"
    )
    name: str | None = Field(default=None, description="not supported: refused when set")
    tool_calls: list[Any] | None = Field(default=None, description="not supported: refused when not empty")
    tool_call_id: str | None = Field(default=None, description="not supported: refused when set")
    function_call: Any = Field(default=None, description="not supported: refused when set")

    def text(self, where: str) -> str:
        """The message's content as one text (parts joined as they are); ``where`` names it in errors."""
        if self.role in ("tool", "function"):
            raise _unsupported(f"{where}.role", f"a {self.role!r} message (tools and functions)")
        for name in ("name", "tool_call_id", "function_call"):
            if getattr(self, name) is not None:
                raise _unsupported(f"{where}.{name}", f"'{name}' in a message")
        if self.tool_calls:
            raise _unsupported(f"{where}.tool_calls", "an assistant message with tool calls")
        if self.content is None:
            raise InvalidParameter(f"{where}.content: a message needs its content", f"{where}.content")
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise _unsupported(f"{where}.content[{j}]", f"content of type {part.type!r} (only text)")
            if part.text is None or part.model_extra:
                raise InvalidParameter(
                    f"{where}.content[{j}]: a text part is {{'type': 'text', 'text': ...}} and nothing else",
                    f"{where}.content[{j}]",
                )
            pieces.append(part.text)
        return "".join(pieces)


class StreamOptions(_Body):
    include_usage: bool | None = Field(
        default=None, description="send one more chunk before [DONE], with no choices and the usage"
    )


# ---------------------------------------------------------------------------- requests
class _Sampling(_Body):
    """What both endpoints take."""

    model: str = Field(min_length=1, max_length=256, description="the id GET /v1/models lists")
    max_tokens: int | None = Field(
        default=None, ge=1, description="at most this many tokens (default: the server's cap)"
    )
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 is greedy; default 1")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="nucleus sampling; default 1")
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX, description="the same seed gives the same answer")
    stop: str | list[str] | None = Field(
        default=None, description=f"up to {MAX_STOP_STRINGS} strings: the answer ends before the first one"
    )
    stream: bool | None = Field(default=None, description="server-sent events, chunk by chunk")
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, description="only 1")
    user: str | None = Field(default=None, max_length=256, description="accepted, not used")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, description="only 0")
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, description="only 0")
    logit_bias: dict[str, float] | None = Field(default=None, description="not supported: refused when not empty")
    # extensions
    session_id: str | None = Field(
        default=None,
        max_length=64,
        description="extension: the stored session this request continues (created when missing)",
    )
    top_k: int | None = Field(default=None, ge=0, description="extension: sample from the k best tokens (0: all)")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in strings):
            raise ValueError("a stop string is not empty")
        return stop

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def refuse_unsupported(self) -> None:
        """Raise :class:`InvalidParameter` naming the first parameter set to what this server does
        not implement."""
        if self.n is not None and self.n != 1:
            raise _unsupported("n", "more than one choice")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options: only allowed when stream is true", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise _unsupported(name, "a penalty other than 0")
        if self.logit_bias:
            raise _unsupported("logit_bias", "a logit bias")


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="the conversation (or, with session_id, its new part)"
    )
    max_completion_tokens: int | None = Field(default=None, ge=1, description="the same as max_tokens")
    logprobs: bool | None = Field(default=None, description="only false")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="not supported: refused when set")
    tools: list[Any] | None = Field(default=None, description="not supported: refused when not empty")
    tool_choice: Any = Field(default=None, description='only "none"')
    parallel_tool_calls: bool | None = Field(default=None, description="accepted without tools (no effect)")
    functions: list[Any] | None = Field(default=None, description="not supported: refused when not empty")
    function_call: Any = Field(default=None, description='only "none"')
    response_format: dict[str, Any] | None = Field(default=None, description='only {"type": "text"}')

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise _unsupported("logprobs", "returning log probabilities")
        if self.top_logprobs is not None:
            raise _unsupported("top_logprobs", "returning log probabilities")
        if self.tools:
            raise _unsupported("tools", "tool calling")
        if self.functions:
            raise _unsupported("functions", "function calling")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise _unsupported(name, "tool calling")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise _unsupported("response_format", f"response_format {self.response_format.get('type')!r} (only text)")

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens``, or ``max_tokens`` (the older name); both must agree."""
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise InvalidParameter(
                "max_tokens and max_completion_tokens are the same limit: give one of them", "max_completion_tokens"
            )
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as templates take them: ``{"role", "content"}``, developer read as system."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text(f"messages[{i}]")}
            for i, m in enumerate(self.messages)
        ]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, or token ids; a list of several prompts is refused (one choice per request)"
    )
    logprobs: int | None = Field(default=None, ge=0, le=5, description="not supported: refused when set")
    echo: bool | None = Field(default=None, description="only false")
    best_of: int | None = Field(default=None, ge=1, description="only 1")
    suffix: str | None = Field(default=None, description="not supported: refused when not empty")

    @field_validator("prompt", mode="before")
    @classmethod
    def _only_integers(cls, prompt: Any) -> Any:
        # a list of ids is checked a slice at a time, refused with one error, not one per item
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list)):
            return only_integers(prompt)
        return prompt

    @field_validator("prompt")
    @classmethod
    def _ids_in_int32(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            check_token_ids(prompt)
        return prompt

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            raise _unsupported("logprobs", "returning log probabilities")
        if self.echo:
            raise _unsupported("echo", "echoing the prompt")
        if self.best_of is not None and self.best_of != 1:
            raise _unsupported("best_of", "more than one candidate")
        if self.suffix:
            raise _unsupported("suffix", "a suffix (insertion)")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids (a list holding one prompt is that prompt)."""
        prompts: list[Any] = [self.prompt]
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            prompts = list(self.prompt)
        if len(prompts) != 1:
            raise _unsupported("prompt", f"a batch of {len(prompts)} prompts (send one per request)")
        (prompt,) = prompts
        if not prompt:
            raise InvalidParameter("prompt: the prompt is empty", "prompt")
        return prompt


# ---------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="tokens of the prompt whose stored rows were reused, not prefilled")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="the whole context: the reused tokens and the new turn's")
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str = Field(description="the engine's fingerprint key (model, geometry, tier)")
    choices: list[ChatChoice]
    usage: Usage
    session_id: str = Field(description="extension: the session holding this conversation (name it to continue)")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
    session_id: str = Field(description="extension: the session holding this conversation (name it to continue)")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class OpenAIError(BaseModel):
    message: str
    type: str = Field(examples=["invalid_request_error"])
    param: str | None = Field(examples=["logprobs"])
    code: str | None = Field(examples=["unsupported_parameter"])


class OpenAIErrorBody(BaseModel):
    """Every error of the ``/v1`` routes, in OpenAI's shape."""

    error: OpenAIError
