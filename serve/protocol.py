"""OpenAI-compatible request/response shapes and error bodies.

Requests are validated here, once, into typed objects: wrong types, out-of-range values
and malformed messages become `APIError`s carrying the OpenAI error body
({"error": {"message", "type", "param", "code"}}) and an HTTP status. Unknown fields
are ignored (clients send options we do not implement, e.g. `user`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An error answered to the client: HTTP status + OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints. Strict types: "10" is not a number of tokens."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)

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


def parse_request(body: bytes, cls: type[SamplingRequest]) -> SamplingRequest:
    """Raw HTTP body -> validated request, or APIError(400) naming the bad field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from None


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
