"""The OpenAI API's request bodies and error shape, as far as a serving target speaks them.

Requests are validated here, before anything reaches the model: a field this server cannot
honour (``n`` > 1, penalties and ``logit_bias``, ``best_of``, a streamed ``echo``, a
``response_format`` other than text, tool or function calls) is a 400 whose ``param``
names it, not a silent change of meaning: a client that asked for JSON or for tool calls
would otherwise take free text for an answer. Fields that change nothing the server returns
(``user``, ``metadata``, ...) and unknown ones are ignored, as OpenAI-compatible servers do.
Types are strict: ``"max_tokens": "5"`` or ``"seed": true`` is a 400, not coerced. A
temperature below ``targets.acceptance.MIN_TEMPERATURE`` samples greedily.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIError(Exception):
    """An error answered in the OpenAI shape: ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error",
             408: "invalid_request_error", 415: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


STRICT = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
"""Every body's rules: unknown fields ignored, no value coerced to a field's type."""

MAX_LOGPROBS = 20
"""The most tokens listed beside each token's log-probability, as OpenAI allows."""

SHOWN_CHARS = 64
"""The most of a client's own text an error message repeats."""


def shown(text: str) -> str:
    """A short, printable prefix of something a client sent, for an error message."""
    clipped = repr(text[:SHOWN_CHARS])[1:-1]
    return clipped + ("..." if len(text) > SHOWN_CHARS else "")


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = STRICT

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    return_token_ids: bool = False
    """Extension: the prompt's and the output's token ids in the response."""

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError("n: this server returns one choice per request; n must be 1")
        if self.presence_penalty or self.frequency_penalty:
            field = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise ValueError(f"{field}: not supported (penalties would change the target's "
                             f"distribution); leave it at 0")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported (it would change the target's "
                             "distribution)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only text (this server does not constrain "
                             "output to JSON)")
        stops = self.stops
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: up to 4 non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self

    @property
    def top_logprobs(self) -> int | None:
        """None: no log-probabilities; else each token's, with this many of the likeliest."""
        return None

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    """0 only with ``echo``: the prompt's log-probabilities alone (as lm-evaluation-harness
    asks for a continuation's likelihood)."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list):
            if len(self.prompt) == 0:
                raise ValueError("prompt: empty")
            if isinstance(self.prompt[0], str | list) and len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request (a batch of prompts is "
                                 "not supported; send them as concurrent requests)")
        if self.echo and self.stream:
            raise ValueError("echo: not with stream (ask for the whole response)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: at least 1 (0 only with echo)")
        if self.suffix:
            raise ValueError("suffix: not supported by this server")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: this server returns one sequence per request; "
                             "best_of must be 1")
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: a whole number from 0 to {MAX_LOGPROBS} (the "
                             f"likeliest tokens listed beside each)")
        return self

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs_: int | None = Field(None, alias="top_logprobs", ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None

    @model_validator(mode="after")
    def _no_tool_calls(self):
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ValueError("logprobs: true or false for chat (top_logprobs says how many "
                             "of the likeliest tokens)")
        if self.top_logprobs_ and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        for field, tools, chooser, choice in (
                ("tools", self.tools, "tool_choice", self.tool_choice),
                ("functions", self.functions, "function_call", self.function_call)):
            if (tools and choice != "none") or choice not in (None, "none", "auto"):
                raise ValueError(f"{field}: this server does not call tools; send none, or "
                                 f"{chooser} 'none'")
        return self

    @property
    def top_logprobs(self) -> int | None:
        return (self.top_logprobs_ or 0) if self.logprobs else None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]
