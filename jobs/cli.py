"""The `dflash` command line: one console script, a subcommand per stage.

    dflash generate --target default [--drafter DIR|default|none|random] --prompt TEXT [--chat] [--json]
    dflash bench    --target default [--drafter DIR|default|random] --dataset mt-bench --json OUT.json
    dflash distill  --config jobs/configs/distill.yaml [key=value ...]
    dflash train    --config jobs/configs/train.yaml [key=value ...]
    dflash export   RUN_DIR OUT_DIR
    dflash corpus   --data DISTILL_DIR --out DRAFTER_DIR/corpus/corpus.safetensors
    dflash serve    --config serve/config.yaml [key=value ...]
    dflash demo     [--config jobs/configs/demo.yaml] [key=value ...]

Stages are imported lazily, so `dflash generate` never pays for importing Ray. Errors a
user can fix (a missing file, a bad key, a drafter for another target) print one line and
exit with status 2; nothing is overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(_k, _v)


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit status 2."""


def _load_target(args):
    from dflash.target import load_target

    try:
        return load_target(args.target, device=args.device, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e


def _decode_config(args):
    """The decoding flags (see _decode_flags) -> a validated dflash.pair.DecodeConfig."""
    from dflash.pair import DecodeConfig

    try:
        return DecodeConfig(target=args.target, drafter=args.drafter, dtype=args.dtype, device=args.device,
                            verify=args.verify, block_size=args.block_size, lookup=args.lookup,
                            lookup_tokens=args.lookup_tokens, corpus=args.corpus, tree_nodes=args.tree_nodes,
                            seed=args.seed, **({} if args.speculation_margin is None
                                               else {"speculation_margin": args.speculation_margin}))
    except ValueError as e:
        raise UserError(str(e)) from e


def _load_pair(args, fallback: str | None = None):
    """-> dflash.pair.DecodingPair for the decoding flags; what a user can fix is a UserError."""
    from safetensors import SafetensorError

    from dflash.pair import load_pair

    cfg = _decode_config(args)
    try:
        pair = load_pair(cfg, fallback=fallback)
    except (FileNotFoundError, ValueError, SafetensorError) as e:
        raise UserError(str(e)) from e
    if cfg.drafter == "auto" and pair.drafter_source in (None, "random"):
        print(f"[dflash] no reference drafter ships for {pair.target.target_id}: using "
              f"{pair.drafter_source or 'no drafter (autoregressive)'}", file=sys.stderr)
    return pair


def _prompt_ids(target, text: str, chat: bool) -> list[int]:
    if chat:
        return target.chat_ids([{"role": "user", "content": text}])
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def _set_threads(n: int | None):
    import torch

    if n:
        torch.set_num_threads(n)


# --- generate ---------------------------------------------------------------------------

def cmd_generate(args) -> int:
    from dflash.decoding import SamplingParams

    _set_threads(args.threads)
    pair = _load_pair(args)
    target = pair.target
    ids = _prompt_ids(target, args.prompt, args.chat)
    if not ids:
        raise UserError("the prompt is empty after tokenization")
    try:
        params = SamplingParams(args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        req = pair.decoder.generate([ids], [params])[0]
    except ValueError as e:
        raise UserError(str(e)) from e
    text = target.tokenizer.decode(req.output_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"prompt_token_ids": ids, "token_ids": req.output_ids, "text": text,
                          "finish_reason": req.finish_reason, "drafter": pair.drafter_source,
                          "stats": req.stats.to_dict()}))
    else:
        print(text)
        s = req.stats
        print(f"\n[{s.generated_tokens} tokens, {s.to_dict()['tokens_per_s']} tok/s, tau {s.tau:.2f}, "
              f"mean verify width {s.to_dict()['mean_verify_width']}, finish {req.finish_reason}]", file=sys.stderr)
    return 0


# --- bench ------------------------------------------------------------------------------

def _bench_temperatures(args) -> list[float]:
    """--temperatures 0,1 wins; else --temperature; else both T=0 and T=1."""
    if args.temperatures:
        try:
            return [float(t) for t in str(args.temperatures).split(",")]
        except ValueError:
            raise UserError(f"--temperatures must be comma-separated numbers, got {args.temperatures!r}") from None
    return [args.temperature] if args.temperature is not None else [0.0, 1.0]


def _refuse_existing(paths: list[str], overwrite: bool) -> None:
    for p in paths:
        if Path(p).exists() and not overwrite and (Path(p).is_file() or any(Path(p).iterdir())):
            raise UserError(f"{p} exists and is not empty; pass --overwrite to replace it")


def cmd_bench(args) -> int:
    """AR vs DFlash (and prompt lookup) per dataset and temperature; JSON, markdown, PNG."""
    from dflash.bench import run_bench
    from dflash.prompts import DATASETS, from_jsonl, load_prompt_set
    from jobs.report import markdown_table, write_bench_report

    _set_threads(args.threads)
    _refuse_existing([p for p in (args.json, args.out) if p], args.overwrite)
    temps = _bench_temperatures(args)
    sets: list[tuple[str, list]] = []
    try:
        if args.prompts:
            if not Path(args.prompts).is_file():
                raise UserError(f"prompts file not found: {args.prompts}")
            sets.append((Path(args.prompts).name, from_jsonl(args.prompts)))
        else:
            names = list(DATASETS) if args.dataset == "all" else args.dataset.split(",")
            for name in names:
                sets.append((name, load_prompt_set(name.strip())))
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from e
    pair = _load_pair(args, fallback="random")
    target = pair.target
    if pair.drafter is None:
        raise UserError("bench compares DFlash with AR: it needs a drafter (a directory, 'default' or 'random')")
    dtype = str(target.dtype).removeprefix("torch.")
    print(f"[bench] dtype {args.dtype} -> {dtype}: {pair.dtype_reason}", file=sys.stderr)
    if args.device == "cpu":
        from dflash.bench import cpu_description

        cpu = cpu_description()
        print(f"[bench] CPU {cpu['model']}: avx512_bf16 {cpu['avx512_bf16']}, amx_bf16 {cpu['amx_bf16']}",
              file=sys.stderr)
    print(f"[bench] width: {'pinned at ' + str(args.block_size) if args.block_size else 'adaptive'}", file=sys.stderr)
    results = []
    for name, convs in sets:
        convs = convs[: args.limit] if args.limit else convs
        if not convs:
            raise UserError(f"{name}: no prompts to benchmark")
        prompts = [target.chat_ids(c) for c in convs]
        for temp in temps:
            def progress(i, n, row, name=name, temp=temp):
                print(f"[bench {name} T={temp:g}] {i}/{n} tau {row['tau']:.2f} exact {row['exact_match']}",
                      file=sys.stderr, flush=True)

            try:
                r = run_bench(pair.decoder, prompts, max_new_tokens=args.max_new_tokens, temperature=temp,
                              top_p=args.top_p, seed=args.seed, prompt_lookup=args.prompt_lookup, progress=progress,
                              drafter_only=args.drafter_only)
            except ValueError as e:  # e.g. a prompt longer than the target's context
                raise UserError(f"{name}: {e}") from e
            results.append({"dataset": name, "target": target.target_id, "drafter": pair.drafter_source,
                            "dtype": dtype, "dtype_reason": pair.dtype_reason, **r})
            if args.vllm and temp == 0:
                results[-1]["vllm"] = _vllm_peer(args, pair, prompts, dtype)
            if r["verify_cost_curve"]:
                print(f"[bench {name} T={temp:g}] verify cost in AR steps by width (batch 1): "
                      + " ".join(f"{w}:{c:.2f}" for w, c in enumerate(r["verify_cost_curve"], 1)), file=sys.stderr)
            print(f"[bench {name} T={temp:g}] cycles by verify width: "
                  + " ".join(f"{w}:{c}" for w, c in enumerate(r["verify_width_histogram"], 1) if c)
                  + f"; acceptance by position {r['acceptance_by_source']}", file=sys.stderr)
    table = markdown_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = results[0] if len(results) == 1 else {"runs": results}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.out:
        files = write_bench_report(results, args.out)
        print(f"[bench] wrote {', '.join(files.values())}", file=sys.stderr)
    print(table, file=sys.stderr)
    keys = ("dataset", "temperature", "tau", "mean_verify_width", "ar_tokens_per_s", "dflash_tokens_per_s", "speedup",
            "lookup_cycle_fraction", "corpus_cycle_fraction", "drafter_only_speedup", "prompt_lookup_speedup", "exact_match_rate", "lossless")
    rows = [{k: r.get(k) for k in keys} for r in results]
    print(json.dumps(rows if len(rows) > 1 else rows[0]))
    return 0


def _vllm_peer(args, pair, prompts: list[list[int]], dtype: str) -> dict:
    """vLLM AR and vLLM DFlash with the same drafter and block on the same prompts (greedy,
    one request at a time, its own venv: jobs/vllm_peer.py): tokens/s, speedup over vLLM's
    own AR, tau and acceptance by position as vLLM counts them, start-up time."""
    from jobs.vllm_peer import VllmUnavailable, run_vllm_many

    if pair.drafter_source in (None, "random"):
        raise UserError("--vllm needs a drafter directory vLLM can load (not 'random')")
    block = pair.decoder.block_size
    runs = [{"name": "ar"}, {"name": "dflash", "drafter": pair.drafter_source, "block": block}]
    print(f"[bench] vLLM peer: AR and DFlash at block {block}, {len(prompts)} prompts", file=sys.stderr, flush=True)
    try:
        report = run_vllm_many(args.target, runs, prompts, args.max_new_tokens, dtype=dtype,
                               stop_token_ids=pair.target.stop_token_ids, sequential=True, threads=args.threads or 2)
    except VllmUnavailable as e:
        raise UserError(str(e)) from e
    ar, spec = report["runs"]
    s = spec["spec"]
    drafts = s.get("num_drafts") or 0
    by_pos = [a / drafts if drafts else None for a in s.get("accepted_per_pos", [])]
    # P(accepted | every draft before it accepted), as dflash.bench reports ours
    conditional = [b / a if a and b is not None else None for a, b in zip([1.0] + by_pos, by_pos)]
    row = {"version": report["vllm_version"], "block": block, "ar_tokens_per_s": ar["tokens_per_s"],
           "dflash_tokens_per_s": spec["tokens_per_s"],
           "speedup": round(spec["tokens_per_s"] / ar["tokens_per_s"], 3) if ar["tokens_per_s"] else None,
           "tau": s.get("tau"), "acceptance_by_position": [round(c, 3) if c is not None else None for c in conditional],
           "startup_s": {"ar": ar["startup_s"], "dflash": spec["startup_s"]}}
    print(f"[bench] vLLM {row['version']}: AR {row['ar_tokens_per_s']:.1f} tok/s, DFlash {row['dflash_tokens_per_s']:.1f} "
          f"tok/s = {row['speedup']}x, tau {row['tau']}", file=sys.stderr)
    return row


# --- config-driven stages ---------------------------------------------------------------

def _run_stage(args, load, run) -> int:
    """A config-driven stage: `load(path, overrides)` validates --config + key=value overrides
    into the stage's dataclass; --print-config shows it; else `run(cfg)` and print its summary."""
    from dflash.config_file import ConfigError, config_to_dict

    try:
        cfg = load(args.config, args.overrides)
    except ConfigError as e:
        raise UserError(str(e)) from e
    if args.print_config:
        print(json.dumps(config_to_dict(cfg), indent=2))
        return 0
    try:
        summary = run(cfg)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise UserError(str(e)) from e
    if summary is not None:
        print(json.dumps(summary, default=str))
    return 0


def _loader(cls):
    from dflash.config_file import load_config

    return lambda path, overrides: load_config(cls, path, overrides)


def cmd_distill(args) -> int:
    from pipelines.distill import DistillConfig, run_distill

    return _run_stage(args, _loader(DistillConfig), run_distill)


def cmd_train(args) -> int:
    from pipelines.train import TrainConfig, run_train

    return _run_stage(args, _loader(TrainConfig), run_train)


def cmd_serve(args) -> int:
    from jobs.serve_run import run_serve
    from serve.config import load_serve_config

    return _run_stage(args, load_serve_config, run_serve)


def cmd_demo(args) -> int:
    from jobs.demo import DemoConfig, run_demo

    return _run_stage(args, _loader(DemoConfig), run_demo)


def _corpus_base(path: str, target, generation: str):
    """The corpus file that `dflash corpus --base` grows: same target, same generation recipe."""
    from dflash.corpus import CorpusIndex, read_corpus_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"base corpus not found: {path}")
    meta = read_corpus_file(path)[2]
    if meta.get("weights_hash") != target.weights_hash:
        raise ValueError(f"base corpus {path} was made from target weights {meta.get('weights_hash')}, "
                         f"this target has {target.weights_hash}")
    if meta.get("generation") != generation:
        raise ValueError(f"base corpus {path} was generated with {meta.get('generation')}, "
                         f"the data with {generation}: a corpus holds answers of one recipe")
    return CorpusIndex.load(path, target.vocab_size)


def cmd_corpus(args) -> int:
    """Distilled answers -> corpus.safetensors for corpus lookup (dflash.corpus)."""
    from dflash.corpus import build_from_distilled
    from dflash.data import DataMismatchError, check_dataset

    _refuse_existing([args.out], args.overwrite)
    if not Path(args.data).is_dir():
        raise UserError(f"data directory not found: {args.data}")
    args.device, args.dtype = "cpu", "fp32"
    target = _load_target(args)
    try:
        meta = check_dataset(args.data, weights_hash=target.weights_hash)
        generation = json.dumps(meta.generation, sort_keys=True)
        base = _corpus_base(args.base, target, generation) if args.base else None
        index = build_from_distilled(args.data, target.vocab_size, base=base, progress=lambda f, n: print(
            f"[corpus] {f.name}: {n} answers so far", file=sys.stderr, flush=True))
    except (FileNotFoundError, DataMismatchError, ValueError) as e:
        raise UserError(str(e)) from e
    extra = {"base": f"{Path(args.base).name}: {len(base.offsets) - 1} answers"} if base is not None else {}
    path = index.save(args.out, {"target_id": target.target_id, "weights_hash": target.weights_hash,
                                 "source": str(Path(args.data).resolve().name), "generation": generation, **extra})
    print(json.dumps({"corpus": str(path), "segments": len(index.offsets) - 1, "tokens": len(index.tokens),
                      "entries": index.num_entries, "bytes": path.stat().st_size}))
    return 0


def cmd_export(args) -> int:
    """A training run -> a drafter directory; or a drafter directory -> another format."""
    from dflash.export_formats import convert_drafter

    src = Path(args.run_dir)
    try:
        if (src / "config.json").is_file():  # a drafter directory: convert it
            out = convert_drafter(src, args.out_dir, args.format, overwrite=args.overwrite)
        else:  # a training run: consolidate its latest checkpoint (vLLM's layout), then convert
            from pipelines.export import export_run

            out = export_run(src, args.out_dir, overwrite=args.overwrite)
            if args.format != "vllm":
                convert_drafter(out, out, args.format)
    except (FileNotFoundError, FileExistsError, ValueError) as e:  # CheckpointError is a ValueError
        raise UserError(str(e)) from e
    print(json.dumps({"exported": str(out), "format": args.format}))
    return 0


# --- parser -----------------------------------------------------------------------------

def _decode_flags(p):
    """The flags of dflash.pair.DecodeConfig (one per field) plus sampling and threads."""
    p.add_argument("--target", default="default", help="'default', a Hugging Face model dir or a .gguf file")
    p.add_argument("--drafter", default="auto",
                   help="a drafter directory; 'default': the reference drafter shipped for the target; "
                        "'none': plain autoregressive; 'random': an untrained one. Default 'auto': the "
                        "shipped one if the target has one, else none (generate) or random (bench)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto (default): bf16 where the device computes it natively (a CPU with "
                        "avx512_bf16/amx_bf16, a GPU that supports it), else fp32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", default="rejection", choices=["rejection", "match"],
                   help="lossless rule at temperature > 0")
    p.add_argument("--block-size", type=int, default=0,
                   help="pin the width: every drafter cycle verifies this many tokens, 2..the block the drafter "
                        "was trained on (experiments). Default 0: adaptive width - each cycle verifies the width "
                        "(1 = a plain AR step .. the drafter's decode block, or a copy's length) that the measured "
                        "verify cost on this machine and the recent acceptance say pays best")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="context lookup (with a drafter; default on): a sequence whose last 2-3 tokens occurred "
                        "earlier drafts the tokens that followed them instead of the drafter's (lossless)")
    p.add_argument("--lookup-tokens", type=int, default=7, help="tokens per copied or corpus draft (default 7)")
    p.add_argument("--corpus", default="auto",
                   help="corpus lookup: where the context has no match, draft the continuation the target most "
                        "often wrote (lossless). 'auto' (default): the drafter directory's "
                        "corpus/corpus.safetensors if it has one; 'none': off; or a file made by `dflash corpus`")
    p.add_argument("--tree-nodes", type=int, default=0,
                   help="verify a draft tree of up to N tokens a cycle: the drafter's block, its runner-up first "
                        "tokens continued by context or corpus copies, and the copies themselves (dflash.tree; "
                        "T > 0 then follows the match rule). 0 (default): one draft a cycle")
    p.add_argument("--speculation-margin", type=float, default=None,
                   help="adaptive width: a speculative cycle must promise this fraction more tokens/s than a plain "
                        "AR step (default: DecodeConfig's, 0.1; 0 where a wide verify is nearly free, e.g. a GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def build_parser() -> argparse.ArgumentParser:
    from dflash.export_formats import FORMATS

    parser = argparse.ArgumentParser(prog="dflash", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="decode one prompt (with the target's reference drafter when one ships)")
    _decode_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the target's chat template to one user message")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("bench", help="AR vs DFlash side by side")
    _decode_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help='JSONL of {"prompt": str} or {"messages": [...]}')
    src.add_argument("--dataset", help="mt-bench, humaneval, aime24, math500, sharegpt-heldout; "
                     "comma-separated, or 'all'")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--drafter-only", action="store_true",
                   help="with lookup or a corpus, also time DFlash without them (the ablation: drafter_only_* fields)")
    p.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers' prompt-lookup decoding (a peer baseline; default on)")
    p.add_argument("--temperatures", default=None, help="comma-separated, e.g. 0,1 (default: --temperature "
                   "if given, else both 0 and 1)")
    p.set_defaults(temperature=None)
    p.add_argument("--vllm", action="store_true",
                   help="also run vLLM AR and vLLM DFlash with the same drafter and block on the same prompts "
                        "(T=0 runs; needs .venv-vllm: `make vllm-venv`); reported under each run's 'vllm'")
    p.add_argument("--json", default=None, help="write the full result here")
    p.add_argument("--out", default=None, help="directory for bench.json, bench.md and PNG plots")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=cmd_bench)

    for name, fn in [("distill", cmd_distill), ("train", cmd_train), ("serve", cmd_serve), ("demo", cmd_demo)]:
        p = sub.add_parser(name, help="the end-to-end demo: distill, train, bench, serve" if name == "demo"
                           else f"run the {name} stage from a YAML config")
        p.add_argument("--config", default=None, help="YAML config (see jobs/configs/)")
        p.add_argument("--print-config", action="store_true", help="validate and print the config, run nothing")
        p.add_argument("overrides", nargs="*", help="key=value overrides")
        p.set_defaults(fn=fn)

    p = sub.add_parser("corpus", help="build a corpus lookup file from distilled data (tokens-only is enough)")
    p.add_argument("--data", required=True, help="a `dflash distill` output directory")
    p.add_argument("--out", required=True, help="the file to write, e.g. <drafter dir>/corpus/corpus.safetensors")
    p.add_argument("--target", default="default", help="the target the data was distilled from")
    p.add_argument("--base", default=None,
                   help="a corpus file to grow: its answers first, then the data's (same target and recipe; "
                        "for data that holds only the shards after the base's, e.g. `jobs.distill_local run "
                        "--shards A:`)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=cmd_corpus)

    p = sub.add_parser("export", help="consolidate a training run into a drafter directory, or convert a "
                                      "drafter directory to another engine's format")
    p.add_argument("run_dir", help="a training run (dflash train's run directory), or a drafter directory")
    p.add_argument("out_dir")
    p.add_argument("--format", default="vllm", choices=FORMATS,
                   help="vllm (default): a reduced draft vocabulary as vLLM stores it (draft_vocab_size, d2t, "
                        "lm_head.weight); sglang / full: no draft vocabulary, the target's own head")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=cmd_export)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"dflash {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
