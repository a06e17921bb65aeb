"""The Ray Serve application: one replica = one target (+ optional DFlash drafter).

    DFlashServer  a Serve deployment wrapping a FastAPI app (@serve.ingress): auth,
                  OpenAI routes, SSE streaming, metrics. Decoding is the BatchingEngine's
                  (serve/engine.py): concurrent requests share batched speculative steps.
    build_app     ServeConfig -> Application (replica resources and autoscaling from the config)
    app_builder   the `import_path` of serve/config.yaml, for `serve run serve/config.yaml`

Routes: POST /v1/completions, POST /v1/chat/completions (stream true/false), GET /v1/models,
GET /health (no auth: for load balancers; reports running/waiting counts).
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` class in
# the route signatures of the ingress class, or it treats `request` as a query parameter (422).
import asyncio
import hmac
import logging
import os
import time
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Application
from ray.serve.metrics import Counter, Gauge, Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve import protocol as P
from serve.config import ServeConfig
from serve.engine import BatchingEngine, ContextTooLong, Generation, StepReport

log = logging.getLogger(__name__)
api = FastAPI(title="dflash", docs_url=None, redoc_url=None)


@api.exception_handler(P.APIError)
async def _api_error(request: Request, exc: P.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = P.APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code)


class IncrementalText:
    """Token ids -> text pieces that are safe to send, cut at the first stop string.

    Text that could still become a stop string (a suffix that is a prefix of one) or an
    unfinished UTF-8 character ("\\ufffd" at the end) is held back until it resolves.
    Example, stop ["\\n\\n"]: text "Hi\\n" sends "Hi" and holds "\\n"; "Hi\\n\\nBye" stops at "Hi".
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self._text()
        if self.stops:
            longest = max(len(s) for s in self.stops)
            start = max(0, self.sent - longest + 1)
            hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                end = max(min(hits), self.sent)
                self.stopped = True
                piece, self.sent = text[self.sent:end], end
                return piece
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        if text.endswith("\ufffd"):
            hold = max(hold, 1)
        end = max(self.sent, len(text) - hold)
        piece, self.sent = text[self.sent:end], end
        return piece

    def flush(self) -> str:
        """What is left once generation ended without a stop string."""
        if self.stopped:
            return ""
        text = self._text()
        piece, self.sent = text[self.sent:], len(text)
        return piece


def load_api_keys(cfg: ServeConfig) -> set[str]:
    """Bearer keys from api_keys_file (one per line, '#' comments) and the env var api_keys_env."""
    keys: set[str] = set()
    if cfg.api_keys_file:
        path = Path(cfg.api_keys_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"api_keys_file {path} not found")
        keys |= {line.strip() for line in path.read_text().splitlines()
                 if line.strip() and not line.strip().startswith("#")}
        if not keys:
            raise ValueError(f"api_keys_file {path} holds no keys")
    if cfg.api_keys_env:
        from_env = {k.strip() for k in os.environ.get(cfg.api_keys_env, "").split(",") if k.strip()}
        if not from_env and not keys:  # fail closed: a configured key source that yields no key
            raise ValueError(f"api_keys_env {cfg.api_keys_env} is unset or empty on this node: refusing to serve "
                             "without auth (set it, or drop api_keys_env to serve without keys)")
        keys |= from_env
    return keys


class ReplicaMetrics:
    """Ray Serve metrics (exported by Ray's metrics agent for Prometheus, prefix ray_)."""

    def __init__(self, block_size: int):
        seconds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
        self.requests = Counter("dflash_requests", "HTTP requests answered", tag_keys=("route", "status"))
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens admitted")
        self.generated_tokens = Counter("dflash_generated_tokens", "Tokens generated")
        self.acceptance = Histogram("dflash_acceptance_length", "Tokens emitted per verify cycle (accepted + 1)",
                                    boundaries=[i + 0.5 for i in range(1, max(block_size, 2))])
        self.draft_time = Histogram("dflash_draft_time_s", "Draft pass time per step", boundaries=seconds)
        self.verify_time = Histogram("dflash_verify_time_s", "Verify pass time per step", boundaries=seconds)
        self.batch_hist = Histogram("dflash_step_batch_size", "Rows per speculative step",
                                    boundaries=[1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5])
        self.batch_size = Gauge("dflash_batch_size", "Rows in the running batch")
        self.queue_depth = Gauge("dflash_queue_depth", "Requests waiting for a batch slot")
        self.latency = Histogram("dflash_request_latency_s", "End-to-end generation time",
                                 boundaries=[0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120])

    def on_step(self, r: StepReport) -> None:
        if r.tokens:
            self.generated_tokens.inc(r.tokens)
        self.batch_size.set(r.batch_size)
        self.queue_depth.set(r.waiting)
        if r.batch_size:
            self.batch_hist.observe(r.batch_size)
            self.draft_time.observe(r.draft_time_s)
            self.verify_time.observe(r.verify_time_s)
            for n in r.acceptance_lengths:
                self.acceptance.observe(n)


@serve.deployment
@serve.ingress(api)
class DFlashServer:
    """One target+drafter pair behind the OpenAI routes; requests batched by the engine."""

    def __init__(self, cfg: ServeConfig):
        import torch

        from dflash.pair import DecodeConfig, load_pair

        torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.api_keys = load_api_keys(cfg)
        pair = load_pair(DecodeConfig.of(cfg))  # CheckpointError names a mismatch: the replica refuses to start
        self.target, self.decoder = pair.target, pair.decoder
        self.drafter_name, self.corpus_name = pair.drafter_source, pair.corpus_source
        self.metrics = ReplicaMetrics(pair.decoder.max_width)
        self.engine = BatchingEngine(pair.decoder, cfg.max_batch_size, cfg.max_context_tokens, self.metrics.on_step)
        self.model_name = cfg.model_name or self.target.target_id
        self.created = int(time.time())
        log.info("replica ready: %s drafter=%s block=%d lookup=%s corpus=%s", self.model_name, self.drafter_name,
                 pair.decoder.block_size, pair.decoder.lookup, self.corpus_name)

    # --- plumbing -------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip(), k) for k in self.api_keys):
            raise P.APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                             type="authentication_error", code="invalid_api_key")

    def _params(self, req: P.SamplingRequest, prompt_len: int):
        from dflash.decoding import SamplingParams

        room = self.engine.room(prompt_len)
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            raise P.APIError(413, f"prompt of {prompt_len} tokens + max_tokens {req.max_tokens or 1} exceeds the "
                                  f"context budget of {self.engine.context_budget} tokens",
                             param="max_tokens" if room >= 1 else "prompt", code="context_length_exceeded")
        greedy = req.temperature == 0 or req.top_p == 0
        return SamplingParams(max_new_tokens=req.max_tokens or min(self.cfg.default_max_tokens, room),
                              temperature=0.0 if greedy else req.temperature,
                              top_p=1.0 if greedy else req.top_p, seed=req.seed)

    def _start(self, req: P.SamplingRequest, prompt_ids: list[int]) -> Generation:
        try:
            gen = self.engine.submit(prompt_ids, self._params(req, len(prompt_ids)))
        except ContextTooLong as e:
            raise P.APIError(413, str(e), code="context_length_exceeded") from None
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return gen

    async def _pieces(self, gen: Generation, text: IncrementalText) -> AsyncIterator[str]:
        """Text pieces of a generation; cancels it at a stop string or when the caller leaves."""
        try:
            async for ids in gen.tokens():
                piece = text.add(ids)
                if piece:
                    yield piece
                if text.stopped:
                    self.engine.cancel(gen, "stop")
                    return
            rest = text.flush()
            if rest:
                yield rest
        finally:
            if not gen.done:  # client disconnected (cancelled) or stop string: free the row
                self.engine.cancel(gen, "stop" if text.stopped else "abort")

    @staticmethod
    def _finish_reason(gen: Generation, text: IncrementalText) -> str:
        return "stop" if text.stopped else (gen.finish_reason or "stop")

    async def _respond(self, route: str, req: P.SamplingRequest, prompt_ids: list[int], chat: bool):
        gen = self._start(req, prompt_ids)
        text = IncrementalText(self.target.tokenizer, req.stop_strings)
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        started = time.perf_counter()
        if req.stream:
            return StreamingResponse(self._stream(route, req, gen, text, rid, chat, started),
                                     media_type="text/event-stream")
        try:
            out = "".join([piece async for piece in self._pieces(gen, text)])
        except RuntimeError as e:
            self.metrics.requests.inc(tags={"route": route, "status": "500"})
            raise P.APIError(500, str(e), type="server_error") from None
        use = P.usage(len(prompt_ids), len(text.ids))
        body = (P.chat_body if chat else P.completion_body)(rid, self.model_name, out,
                                                            self._finish_reason(gen, text), use, gen.stats())
        self.metrics.requests.inc(tags={"route": route, "status": "200"})
        self.metrics.latency.observe(time.perf_counter() - started)
        return body

    async def _stream(self, route, req, gen, text, rid, chat, started) -> AsyncIterator[str]:
        model = self.model_name
        obj = "chat.completion.chunk" if chat else "text_completion"
        status = "200"
        try:
            if chat:
                yield P.sse(P.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
            async for piece in self._pieces(gen, text):
                yield P.sse(P.chat_chunk(rid, model, {"content": piece}, None) if chat
                            else P.completion_body(rid, model, piece, None))
            reason = self._finish_reason(gen, text)
            yield P.sse(P.chat_chunk(rid, model, {}, reason, gen.stats()) if chat
                        else P.completion_body(rid, model, "", reason, stats=gen.stats()))
            if req.include_usage_in_stream:
                yield P.sse(P.usage_chunk(rid, model, obj, P.usage(len(gen.prompt_ids), len(text.ids))))
        except RuntimeError as e:
            status = "500"
            yield P.sse(P.APIError(500, str(e), type="server_error").body())
        except asyncio.CancelledError:
            status = "499"  # client went away; _pieces has cancelled the generation
            raise
        finally:
            if not gen.done:  # closed mid-stream: free the row even if _pieces is left suspended
                self.engine.cancel(gen, "stop" if text.stopped else "abort")
            self.metrics.requests.inc(tags={"route": route, "status": status})
            self.metrics.latency.observe(time.perf_counter() - started)
        yield P.sse("[DONE]")

    # --- routes ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "steps": self.engine.counters.steps, "max_batch_size_seen": self.engine.counters.max_batch_size_seen,
                "block_size": self.decoder.block_size, "max_width": self.decoder.max_width}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "dflash", "drafter": self.drafter_name,
                                            "corpus": self.corpus_name}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            self._authorize(request)
            req = P.parse_request(await request.body(), P.CompletionRequest)
            if isinstance(req.prompt, str):
                ids = self.target.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
            else:
                ids = list(req.prompt)
                if max(ids) >= self.target.vocab_size:
                    raise P.APIError(400, f"prompt: token id {max(ids)} >= vocabulary size {self.target.vocab_size}",
                                     param="prompt")
            if not ids:
                raise P.APIError(400, "prompt: encodes to no tokens", param="prompt")
            return await self._respond("completions", req, ids, chat=False)
        except P.APIError as e:
            self.metrics.requests.inc(tags={"route": "completions", "status": str(e.status)})
            raise

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            self._authorize(request)
            req = P.parse_request(await request.body(), P.ChatCompletionRequest)
            try:
                ids = self.target.chat_ids(req.template_messages())
            except P.APIError:
                raise
            except Exception as e:  # the template itself refused the conversation
                raise P.APIError(400, f"messages: chat template failed: {e}", param="messages") from None
            return await self._respond("chat", req, ids, chat=True)
        except P.APIError as e:
            self.metrics.requests.inc(tags={"route": "chat", "status": str(e.status)})
            raise


def build_app(cfg: ServeConfig) -> Application:
    """The deployment, sized and autoscaled from the config, bound to its config. A drafter
    that does not fit the target is refused here, before any replica starts."""
    from dflash.pair import DecodeConfig, check_pair

    if cfg.ray_address is None:  # local: refuse a key source that yields no key before any replica starts
        load_api_keys(cfg)
    check_pair(DecodeConfig.of(cfg))
    autoscaling = {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas,
                   "target_ongoing_requests": cfg.target_ongoing_requests,
                   "upscale_delay_s": cfg.upscale_delay_s, "downscale_delay_s": cfg.downscale_delay_s}
    if cfg.initial_replicas is not None:
        autoscaling["initial_replicas"] = cfg.initial_replicas
    return DFlashServer.options(
        ray_actor_options={"num_cpus": cfg.num_cpus_per_replica, "num_gpus": cfg.num_gpus_per_replica},
        autoscaling_config=autoscaling,
        max_ongoing_requests=cfg.max_ongoing_requests,
    ).bind(cfg)


def app_builder(args: dict) -> Application:
    """`serve run serve/config.yaml` entry: the application's `args` are ServeConfig fields."""
    from dflash.config_file import build_config

    return build_app(build_config(ServeConfig, dict(args or {}), "serve application args"))
