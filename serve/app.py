"""The Ray Serve application: one replica = one target (+ optional DFlash drafter).

    DFlashServer  a Serve deployment wrapping a FastAPI app (@serve.ingress): auth,
                  OpenAI routes, SSE streaming, metrics. Decoding is the BatchingEngine's
                  (serve/engine.py: concurrent requests share batched speculative steps),
                  or with `engine: vllm` vLLM's in a child process (serve/vllm_engine.py)
    build_app     ServeConfig -> Application (replica resources and autoscaling from the config)
    app_builder   the `import_path` of serve/config.yaml, for `serve run serve/config.yaml`

Routes: POST /v1/completions, POST /v1/chat/completions (stream true/false), GET /v1/models,
GET /health (no auth: for load balancers; reports running/waiting counts).

Limits (ServeConfig): a body over max_body_bytes is refused (413) before it is read; JSON
parsing, chat templates and tokenization run on one worker thread, never on the event
loop; at most max_queued_requests wait for a batch slot (429 + Retry-After beyond); a
request past request_timeout_s is cut (503, or an error event in a stream); every error,
unexpected ones included, is an OpenAI JSON body, and unexpected ones are logged with the
request id. Draining on shutdown (jobs/serve_run.py sets the deadline in Ray's KV store):
new requests get 503, in-flight ones run until the deadline, then end with an error.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` class in
# the route signatures of the ingress class, or it treats `request` as a query parameter (422).
import asyncio
import hmac
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve import protocol as P
from serve.config import ServeConfig
from serve.engine import BatchingEngine, ContextTooLong, Generation
from serve.metrics import ReplicaMetrics
from serve.text import IncrementalText, public_name, special_token_texts

log = logging.getLogger(__name__)
api = FastAPI(title="dflash", docs_url=None, redoc_url=None)
RETRY_AFTER_S = 2  # what a 429 (queue full) or a 503 (timed out waiting) advises
SHUTDOWN_RETRY_AFTER_S = 5


def drain_key(app_name: str) -> bytes:
    """Ray KV key where the foreground runner posts the drain deadline (unix seconds)."""
    return f"dflash/drain/{app_name}".encode()


@api.exception_handler(P.APIError)
async def _api_error(request: Request, exc: P.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = P.APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code)


@api.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Last resort (the routes convert their own errors): never a bare 500."""
    rid = P.new_id("req")
    log.error("request %s %s failed: %r", rid, request.url.path, exc, exc_info=exc)
    err = P.APIError(500, f"internal error (request id {rid})", type="server_error")
    return JSONResponse(err.body(), status_code=500)


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
        if cfg.engine == "vllm":  # vLLM decodes in its own process; we keep the text side
            from serve.vllm_engine import start_vllm_engine

            self.target, self.engine, self.drafter_name = start_vllm_engine(cfg)
            self.corpus_name = None
            self.metrics = ReplicaMetrics(self.engine.max_width)
        else:
            pair = load_pair(DecodeConfig.of(cfg))  # CheckpointError names a mismatch: the replica refuses to start
            self.target = pair.target
            self.drafter_name, self.corpus_name = pair.drafter_source, pair.corpus_source
            self.metrics = ReplicaMetrics(pair.decoder.max_width)
            self.engine = BatchingEngine(pair.decoder, cfg.max_batch_size, cfg.max_context_tokens,
                                         self.metrics.on_step, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
                                         prefill_slice_s=cfg.prefill_slice_ms / 1000,
                                         prefill_share=cfg.prefill_share)
        self.model_name = cfg.model_name or self.target.target_id
        self.model_names = {self.model_name, cfg.app_name}  # what `model` may say (the app name is an alias)
        self.specials = special_token_texts(self.target.tokenizer)
        self.created = int(time.time())
        self._started_at = time.time()
        # JSON parsing, chat templates, tokenization: one thread (the tokenizer is not shared across threads)
        self._text_pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-text")
        self._live: dict[int, Generation] = {}  # id(gen) -> gen (a dataclass: unhashable)
        self._drain_deadline: float | None = None  # unix seconds, once the runner asked this app to drain
        self._drain_task: asyncio.Task | None = None
        log.info("replica ready: %s engine=%s drafter=%s corpus=%s %s", self.model_name, cfg.engine,
                 self.drafter_name, self.corpus_name, self.engine.describe())

    # --- plumbing -------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        """Constant time over every key; bytes, so any header text (non-ASCII included) compares."""
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        given = key.strip().encode("utf-8", "surrogateescape")
        ok = False
        for k in self.api_keys:
            ok |= hmac.compare_digest(given, k.encode("utf-8", "surrogateescape"))
        if scheme.lower() != "bearer" or not ok:
            raise P.APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                             type="authentication_error", code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) past max_body_bytes: by Content-Length before reading, else while reading."""
        limit = self.cfg.max_body_bytes
        too_large = P.APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > limit):
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, req: P.SamplingRequest) -> None:
        if req.model is not None and req.model not in self.model_names:
            raise P.APIError(404, f"model {req.model!r} not found (this server serves {self.model_name!r})",
                             param="model", code="model_not_found")

    def _check_accepting(self) -> None:
        self._watch_drain()
        if self._drain_deadline is not None:
            raise P.APIError(503, "server is shutting down", type="server_error", code="shutting_down",
                             retry_after_s=SHUTDOWN_RETRY_AFTER_S)

    # --- drain on shutdown --------------------------------------------------------------------
    def _watch_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain_watch())

    async def _drain_watch(self) -> None:
        """Poll Ray's KV for the runner's drain deadline; at the deadline end what still runs."""
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

        key = drain_key(self.cfg.app_name)
        while self._drain_deadline is None:
            await asyncio.sleep(0.5)
            try:
                raw = _internal_kv_get(key) if _internal_kv_initialized() else None
            except Exception:  # the GCS going away is not this replica's failure
                raw = None
            if raw and float(raw) > self._started_at:  # a deadline posted before this replica began is stale
                self._drain_deadline = float(raw)
        log.info("draining: %d requests in flight, deadline in %.1f s", len(self._live),
                 self._drain_deadline - time.time())
        while self._live and time.time() < self._drain_deadline:
            await asyncio.sleep(0.1)
        for gen in list(self._live.values()):
            self.engine.cancel(gen, "shutdown")

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
                              top_p=1.0 if greedy else req.top_p, seed=req.seed, ignore_eos=req.ignore_eos)

    def _start(self, req: P.SamplingRequest, prompt_ids: list[int]) -> Generation:
        params = self._params(req, len(prompt_ids))
        self._check_accepting()
        if self.engine.num_waiting >= self.cfg.max_queued_requests:
            raise P.APIError(429, f"server busy: {self.engine.num_waiting} requests already wait for a batch slot",
                             type="rate_limit_error", code="queue_full", retry_after_s=RETRY_AFTER_S)
        try:
            gen = self.engine.submit(prompt_ids, params)
        except ContextTooLong as e:
            raise P.APIError(413, str(e), code="context_length_exceeded") from None
        self._live[id(gen)] = gen
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return gen

    async def _pieces(self, gen: Generation, text: IncrementalText, deadline: float) -> AsyncIterator[str]:
        """Text pieces of a generation; cancels it at a stop string, when the caller leaves
        or at the deadline (loop time; APIError 503), and turns a drain cut into APIError 503."""
        loop = asyncio.get_running_loop()
        tokens = gen.tokens()
        try:
            while True:
                try:
                    ids = await asyncio.wait_for(anext(tokens), max(0.0, deadline - loop.time()))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    queued = not gen.started
                    self.engine.cancel(gen, "timeout")
                    raise P.APIError(503, f"request timed out after {self.cfg.request_timeout_s:g} s "
                                          f"({'waiting for a batch slot' if queued else 'generating'})",
                                     type="server_error", code="timeout",
                                     retry_after_s=RETRY_AFTER_S if queued else None) from None
                piece = text.add(ids)
                if piece:
                    yield piece
                if text.stopped:
                    self.engine.cancel(gen, "stop")
                    return
            if gen.finish_reason == "shutdown":
                raise P.APIError(503, "server shut down before the request finished", type="server_error",
                                 code="shutting_down", retry_after_s=SHUTDOWN_RETRY_AFTER_S)
            rest = text.flush()
            if rest:
                yield rest
        finally:
            if not gen.done:  # client disconnected (cancelled) or stop string: free the row
                self.engine.cancel(gen, "stop" if text.stopped else "abort")
            self._live.pop(id(gen), None)

    @staticmethod
    def _finish_reason(gen: Generation, text: IncrementalText) -> str:
        return "stop" if text.stopped else (gen.finish_reason or "stop")

    async def _respond(self, route: str, rid: str, req: P.SamplingRequest, prompt_ids: list[int], chat: bool,
                       deadline: float):
        gen = self._start(req, prompt_ids)
        text = IncrementalText(self.target.tokenizer, req.stop_strings)
        started = time.perf_counter()
        if req.stream:
            return StreamingResponse(self._stream(route, req, gen, text, rid, chat, started, deadline),
                                     media_type="text/event-stream")
        try:
            out = "".join([piece async for piece in self._pieces(gen, text, deadline)])
        except RuntimeError as e:
            log.error("request %s: %s", rid, e)
            raise P.APIError(500, f"{e} (request id {rid})", type="server_error") from None
        use = P.usage(len(prompt_ids), len(text.ids))
        body = (P.chat_body if chat else P.completion_body)(rid, self.model_name, out,
                                                            self._finish_reason(gen, text), use, gen.stats())
        self.metrics.requests.inc(tags={"route": route, "status": "200"})
        self.metrics.latency.observe(time.perf_counter() - started)
        return body

    async def _stream(self, route, req, gen, text, rid, chat, started, deadline) -> AsyncIterator[str]:
        model = self.model_name
        obj = "chat.completion.chunk" if chat else "text_completion"
        status = "200"
        try:
            if chat:
                yield P.sse(P.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
            async for piece in self._pieces(gen, text, deadline):
                yield P.sse(P.chat_chunk(rid, model, {"content": piece}, None) if chat
                            else P.completion_body(rid, model, piece, None))
            reason = self._finish_reason(gen, text)
            yield P.sse(P.chat_chunk(rid, model, {}, reason, gen.stats()) if chat
                        else P.completion_body(rid, model, "", reason, stats=gen.stats()))
            if req.include_usage_in_stream:
                yield P.sse(P.usage_chunk(rid, model, obj, P.usage(len(gen.prompt_ids), len(text.ids))))
        except P.APIError as e:  # timeout or shutdown: the status line is sent, so an error event
            status = str(e.status)
            yield P.sse(e.body())
        except asyncio.CancelledError:
            status = "499"  # client went away; _pieces has cancelled the generation
            raise
        except Exception as e:  # engine failure (RuntimeError) or anything unexpected
            status = "500"
            log.error("request %s failed mid-stream: %r", rid, e, exc_info=not isinstance(e, RuntimeError))
            yield P.sse(P.APIError(500, f"{e} (request id {rid})", type="server_error").body())
        finally:
            if not gen.done:  # closed mid-stream: free the row even if _pieces is left suspended
                self.engine.cancel(gen, "stop" if text.stopped else "abort")
            self._live.pop(id(gen), None)
            self.metrics.requests.inc(tags={"route": route, "status": status})
            self.metrics.latency.observe(time.perf_counter() - started)
        yield P.sse("[DONE]")

    # --- routes ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "steps": self.engine.counters.steps, "max_batch_size_seen": self.engine.counters.max_batch_size_seen,
                **self.engine.describe()}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "dflash", "drafter": public_name(self.drafter_name),
                                            "corpus": public_name(self.corpus_name, self.drafter_name)}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle("completions", request, self._completion_ids)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle("chat", request, self._chat_ids)

    def _completion_ids(self, body: bytes) -> tuple[P.SamplingRequest, list[int]]:
        """Runs on the text thread: parse, check, tokenize."""
        req = P.parse_request(body, P.CompletionRequest)
        self._check_model(req)
        if isinstance(req.prompt, str):
            ids = self.target.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = list(req.prompt)
            if max(ids) >= self.target.vocab_size:
                raise P.APIError(400, f"prompt: token id {max(ids)} >= vocabulary size {self.target.vocab_size}",
                                 param="prompt")
        if not ids:
            raise P.APIError(400, "prompt: encodes to no tokens", param="prompt")
        return req, ids

    def _chat_ids(self, body: bytes) -> tuple[P.SamplingRequest, list[int]]:
        """Runs on the text thread: parse, check, template. Message text that spells a control
        token (<|im_start|>, ...) is refused: the template would turn it into one (a forged role)."""
        req = P.parse_request(body, P.ChatCompletionRequest)
        self._check_model(req)
        messages = req.template_messages()
        for i, m in enumerate(messages):
            hit = next((t for t in self.specials if t in m["content"]), None)
            if hit is not None:
                raise P.APIError(400, f"messages.{i}.content: contains the control token text {hit!r}",
                                 param=f"messages.{i}.content")
        try:
            ids = self.target.chat_ids(messages)
        except Exception as e:  # the template itself refused the conversation
            raise P.APIError(400, f"messages: chat template failed: {e}", param="messages") from None
        return req, ids

    async def _handle(self, route: str, request: Request,
                      prepare: Callable[[bytes], tuple[P.SamplingRequest, list[int]]]):
        """One generation route: every outcome counted; every error an OpenAI body."""
        rid = P.new_id("chatcmpl" if route == "chat" else "cmpl")
        try:
            self._check_accepting()
            self._authorize(request)
            body = await self._read_body(request)
            deadline = asyncio.get_running_loop().time() + self.cfg.request_timeout_s
            req, ids = await asyncio.get_running_loop().run_in_executor(self._text_pool, prepare, body)
            return await self._respond(route, rid, req, ids, chat=route == "chat", deadline=deadline)
        except P.APIError as e:
            self.metrics.requests.inc(tags={"route": route, "status": str(e.status)})
            raise
        except asyncio.CancelledError:  # the client left before the answer
            self.metrics.requests.inc(tags={"route": route, "status": "499"})
            raise
        except Exception as e:
            log.exception("request %s failed", rid)
            self.metrics.requests.inc(tags={"route": route, "status": "500"})
            raise P.APIError(500, f"internal error (request id {rid}): {type(e).__name__}", type="server_error") from None


def build_app(cfg: ServeConfig) -> Application:
    """The deployment, sized and autoscaled from the config, bound to its config. A drafter
    that does not fit the target is refused here, before any replica starts."""
    from dflash.pair import DecodeConfig, check_pair

    if cfg.ray_address is None:  # local: refuse a key source that yields no key before any replica starts
        load_api_keys(cfg)
        if cfg.engine == "vllm":  # ... or an engine that is not installed (FileNotFoundError)
            from dflash.vllm_env import vllm_python

            vllm_python()
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
        # Serve's router queue is bounded too (429 + Retry-After, Serve's plain-text body). It also counts
        # requests in the instant before they reach a replica, so its bound leaves room for what the
        # replicas themselves hold: the replicas' JSON 429 is the one clients normally see.
        max_queued_requests=cfg.max_queued_requests + cfg.max_ongoing_requests * cfg.max_replicas,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        # a stopped replica finishes its requests (the runner's drain deadline cuts them first)
        graceful_shutdown_timeout_s=cfg.drain_timeout_s + 10, graceful_shutdown_wait_loop_s=0.5,
    ).bind(cfg)


def app_builder(args: dict) -> Application:
    """`serve run serve/config.yaml` entry: the application's `args` are ServeConfig fields."""
    from dflash.config_file import build_config

    return build_app(build_config(ServeConfig, dict(args or {}), "serve application args"))
