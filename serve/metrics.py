"""Replica metrics: Ray Serve metrics exported by Ray's metrics agent for Prometheus
(prefix ray_), fed by the engine's StepReport after every step."""

from ray.serve.metrics import Counter, Gauge, Histogram

from serve.engine import StepReport


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
        self.width = Histogram("dflash_verify_width", "Verify width chosen per step (1: a plain AR step)",
                               boundaries=[i + 0.5 for i in range(1, max(block_size, 2))])
        self.prefill_tokens = Counter("dflash_prefill_tokens", "Prompt tokens prefilled (in chunks between steps)")
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
            self.width.observe(r.width)
            for n in r.acceptance_lengths:
                self.acceptance.observe(n)
        if r.prefill_tokens:
            self.prefill_tokens.inc(r.prefill_tokens)
