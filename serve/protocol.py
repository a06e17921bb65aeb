"""OpenAI-compatible request/response shapes and error bodies.

Requests are validated here, once, into typed objects: wrong types, out-of-range values
and malformed messages become `APIError`s carrying the OpenAI error body
({"error": {"message", "type", "param", "code"}}) and an HTTP status. Unknown fields
are ignored (clients send options that change nothing here, e.g. `user`), but an option
that would change the answer and is not implemented (`logprobs`, `echo`, `tools`, ...)
is refused with a 400 naming it unless it holds its no-op value.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash.sampling import OPENAI_MAX_TEMPERATURE


MAX_STOP_STRINGS = 4
MAX_JSON_DEPTH = 32  # no valid request nests deeper than ~5 levels

# Options that change the answer and are not implemented: refused unless they hold the
# value that means "off". (`n` is a validated field: 1 only.)
UNSUPPORTED_OPTIONS: dict[str, tuple] = {
    "logprobs": (None, 0, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
}


class APIError(Exception):
    """An error answered to the client: HTTP status + OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints. Strict types: "10" is not a number of tokens."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # the core's range rule (dflash.sampling), narrowed where the OpenAI spec says: T <= 2
    temperature: float = Field(default=1.0, ge=0.0, le=OPENAI_MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model's stop token
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        if isinstance(data, dict):
            for name, off in UNSUPPORTED_OPTIONS.items():
                if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in off):
                    raise ValueError(f"{name}: not supported by this server (omit it or send {off[-1]!r})")
        return data

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _number(cls, v):
        # strict mode refuses an int for a float field; JSON has no such distinction
        if isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("one prompt per request")
                v = v[0]
            elif any(t < 0 for t in v):
                raise ValueError("token ids must be >= 0")
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """Content as plain text; list content must be text parts."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: a non-empty list of messages."""

    messages: list[ChatMessage] = Field(min_length=1)

    def template_messages(self) -> list[dict]:
        """Messages as the chat template takes them ("developer" is OpenAI's new "system")."""
        try:
            return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in self.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(body: bytes | str) -> int:
    """Deepest nesting of [ and { outside strings, found without recursion."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    depth = deepest = 0
    for m in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def invalid_text(data: Any, path: str = "") -> str | None:
    """The path of the first string holding a lone surrogate ("\\ud800": not Unicode text), or None."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(data, dict):
        for k, v in data.items():
            bad = invalid_text(k, path) or invalid_text(v, f"{path}.{k}" if path else str(k))
            if bad:
                return bad
    elif isinstance(data, list):
        for i, v in enumerate(data):
            bad = invalid_text(v, f"{path}.{i}")
            if bad:
                return bad
    return None


def parse_request(body: bytes, cls: type[SamplingRequest]) -> SamplingRequest:
    """Raw HTTP body -> validated request, or APIError(400) naming the bad field."""
    if json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    bad = invalid_text(data)
    if bad:
        raise APIError(400, f"{bad}: not valid Unicode text (a lone surrogate escape such as \\ud800)", param=bad)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        if param is None and ":" in msg and msg.split(":")[0] in UNSUPPORTED_OPTIONS:
            param = msg.split(":")[0]
        raise APIError(400, f"{param}: {msg}" if param and not msg.startswith(f"{param}:") else msg,
                       param=param) from None


# --- responses ------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish_reason: str | None,
                    use: dict | None = None, stats: dict | None = None) -> dict:
    """A whole completion, or one streamed chunk of it (same shape)."""
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if use is not None:
        body["usage"] = use
    if stats is not None:
        body["dflash"] = stats
    return body


def chat_body(rid: str, model: str, text: str, finish_reason: str | None,
              use: dict | None = None, stats: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}]}
    if use is not None:
        body["usage"] = use
    if stats is not None:
        body["dflash"] = stats
    return body


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None,
               stats: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if stats is not None:
        body["dflash"] = stats
    return body


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    """The extra last chunk of stream_options.include_usage: empty choices, usage set."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}


def sse(data: dict | str) -> str:
    """One server-sent event line pair."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
