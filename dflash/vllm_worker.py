"""vLLM's async engine behind a pipe: the child process of serve/vllm_engine.py (a replica)
and pipelines/vllm_generate.py (a distillation actor).

    .venv-vllm/bin/python dflash/vllm_worker.py SPEC_JSON

A program, imported by no module: it runs in the vLLM venv (dflash/vllm_env.py), so it
imports only vLLM and the standard library. SPEC_JSON:

    {"target": DIR, "dtype": "bfloat16", "max_model_len": 8192, "max_num_seqs": 8,
     "drafter": DIR or null, "block": 4, "seed": 0}

Protocol: one JSON object per line. The parent writes to our stdin
    {"op": "generate", "id": "r1", "prompt_ids": [...], "max_tokens": 64, "temperature": 0.0,
     "top_p": 1.0, "seed": null, "stop_token_ids": [2], "ignore_eos": false}
    {"op": "abort", "id": "r1"}
and reads from our stdout
    {"event": "ready", "version": "0.32.0"}                          once, after start-up
    {"id": "r1", "tokens": [...], "finish": null | "stop" | "length"} new tokens, as they come
    {"id": "r1", "error": "..."}                                     the request failed
Everything else that would reach stdout (vLLM's own prints) goes to stderr. Closing our
stdin (the parent exited) shuts the engine down.

vLLM runs its engine core in child processes. They must not outlive us, even when we are
SIGKILLed (Ray kills an actor's children when the actor goes): we lead our own process
group, and a forked watchdog kills the whole group once we are gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time


def watch_over_group() -> None:
    """Lead a process group (vLLM's children join it) and fork a watchdog that kills the
    group, itself included, once this process is gone, however it died."""
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)
    me = os.getpid()
    if os.fork() == 0:  # the watchdog: stdlib only, no pipes held
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        while os.getppid() == me:
            time.sleep(0.5)
        os.killpg(me, signal.SIGKILL)
        os._exit(0)


def protocol_stdout():
    """A private handle on the real stdout; fd 1 itself is pointed at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


async def serve(spec: dict, out) -> None:
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    kwargs = {}
    if spec.get("drafter"):
        kwargs["speculative_config"] = {"method": "dflash", "model": spec["drafter"],
                                        "num_speculative_tokens": int(spec["block"]) - 1}
    args = AsyncEngineArgs(model=spec["target"], dtype=spec["dtype"], max_model_len=int(spec["max_model_len"]),
                           max_num_seqs=int(spec["max_num_seqs"]), enforce_eager=True, seed=int(spec.get("seed", 0)),
                           **kwargs)
    engine = AsyncLLM.from_engine_args(args)
    send({"event": "ready", "version": vllm.__version__})

    async def generate(req: dict) -> None:
        rid = req["id"]
        params = SamplingParams(max_tokens=int(req["max_tokens"]), temperature=float(req.get("temperature", 0.0)),
                                top_p=float(req.get("top_p", 1.0)), seed=req.get("seed"), detokenize=False,
                                stop_token_ids=list(req.get("stop_token_ids") or []),
                                ignore_eos=bool(req.get("ignore_eos", False)),
                                output_kind=RequestOutputKind.DELTA)
        try:
            async for result in engine.generate(TokensPrompt(prompt_token_ids=list(req["prompt_ids"])), params, rid):
                o = result.outputs[0]
                send({"id": rid, "tokens": list(o.token_ids), "finish": o.finish_reason if result.finished else None})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one bad request must not stop the others
            send({"id": rid, "error": f"{type(e).__name__}: {e}"})

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: dict[str, asyncio.Task] = {}
    try:
        while line := await reader.readline():
            msg = json.loads(line)
            if msg["op"] == "generate":
                tasks[msg["id"]] = task = loop.create_task(generate(msg))
                task.add_done_callback(lambda t, rid=msg["id"]: tasks.pop(rid, None))
            elif msg["op"] == "abort" and msg["id"] in tasks:
                await engine.abort(msg["id"])
                tasks[msg["id"]].cancel()
    finally:
        for task in list(tasks.values()):
            task.cancel()
        engine.shutdown()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    watch_over_group()
    out = protocol_stdout()
    asyncio.run(serve(spec, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
