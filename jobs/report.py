"""Benchmark reports: a markdown table and PNG plots from `dflash bench` results."""

from __future__ import annotations

import json
from pathlib import Path


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def markdown_table(results: list[dict]) -> str:
    """One row per (dataset, temperature). "copied" and "corpus" are the fractions of cycles
    that drafted by context lookup and by corpus lookup; "drafter only" the ablation without
    either (tau, speedup); "width" the mean verify width and whether it was adaptive or pinned."""
    head = ("| dataset | T | prompts | tau | width | AR tok/s | DFlash tok/s | speedup | copied | corpus | drafter only "
            "| prompt-lookup speedup | exact match | lossless |")
    lines = [head, "|" + "---|" * 14]
    for r in results:
        pl = r.get("prompt_lookup_speedup")
        alone = (f"{r['drafter_only_tau']:.2f}, {r['drafter_only_speedup']:.2f}x"
                 if r.get("drafter_only_speedup") is not None else "-")
        copied = f"{r['lookup_cycle_fraction']:.2f}" if r.get("lookup") else "-"
        corpus = f"{r['corpus_cycle_fraction']:.2f}" if r.get("corpus") else "-"
        lossless = {True: "yes", False: "NO", None: "n/a (T>0)"}[r["lossless"]]
        width = f"{r['mean_verify_width']:.2f} {r['width']}" if r.get("width") else "-"
        lines.append(
            f"| {r['dataset']} | {r['temperature']:g} | {r['num_prompts']} | {r['tau']:.2f} | {width} | "
            f"{r['ar_tokens_per_s']:.1f} | {r['dflash_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {copied} | {corpus} | {alone} | "
            f"{'-' if pl is None else f'{pl:.2f}x'} | {r['exact_match_rate']:.2f} | {lossless} |")
    return "\n".join(lines) + "\n"


def write_bench_report(results: list[dict], out_dir: str | Path) -> dict[str, str]:
    """bench.json, bench.md and the two PNG plots in `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "bench.json", "table": out / "bench.md", "acceptance_plot": out / "acceptance_histogram.png",
             "speedup_plot": out / "speedup.png"}
    files["json"].write_text(json.dumps({"runs": results}, indent=2) + "\n")
    files["table"].write_text(markdown_table(results))
    plot_acceptance(results, files["acceptance_plot"])
    plot_speedup(results, files["speedup_plot"])
    return {k: str(v) for k, v in files.items()}


def plot_acceptance(results: list[dict], path: str | Path) -> Path:
    """Acceptance-length histogram (fraction of cycles emitting k tokens), one series per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    n = max(1, len(results))
    width = 0.8 / n
    for i, r in enumerate(results):
        hist = r["acceptance_histogram"]
        total = max(1, sum(hist))
        xs = [k + 1 + (i - (n - 1) / 2) * width for k in range(len(hist))]
        ax.bar(xs, [c / total for c in hist], width=width, label=f"{r['dataset']} T={r['temperature']:g} "
               f"(tau {r['tau']:.2f})")
    ax.set_xlabel("tokens emitted per verify cycle (accepted + 1)")
    ax.set_ylabel("fraction of cycles")
    ax.set_title("DFlash acceptance lengths")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_speedup(results: list[dict], path: str | Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['dataset']}\nT={r['temperature']:g}" for r in results]
    ax.bar(range(len(results)), [r["speedup"] for r in results], color="tab:blue", label="DFlash")
    pl = [r.get("prompt_lookup_speedup") for r in results]
    if any(v is not None for v in pl):
        ax.scatter(range(len(results)), [v if v is not None else float("nan") for v in pl], color="tab:orange",
                   zorder=3, label="prompt lookup")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks(range(len(results)), labels, fontsize=7)
    ax.set_ylabel("speedup over autoregressive")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _window_mean(rows: list[list[float]]) -> list[float]:
    return [sum(col) / len(col) for col in zip(*rows)]


def plot_training(metrics: list[dict], path: str | Path) -> Path:
    """Training loss (raw and a moving average) and per-block-position accuracy, averaged
    over the first and the last tenth of the steps (one step's accuracy is too noisy)."""
    plt = _pyplot()
    rows = [m for m in metrics if "loss" in m]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [m.get("step", i) for i, m in enumerate(rows)]
    losses = [m["loss"] for m in rows]
    w = max(1, len(rows) // 20)
    smooth = [sum(losses[max(0, i - w + 1): i + 1]) / len(losses[max(0, i - w + 1): i + 1]) for i in range(len(losses))]
    a1.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="per step")
    a1.plot(steps, smooth, color="tab:blue", label=f"mean of {w}")
    a1.set_xlabel("step")
    a1.set_ylabel("loss")
    a1.set_yscale("log")
    a1.set_title("training loss")
    a1.legend()
    accs = [m["accuracy"] for m in rows if m.get("accuracy")]
    if accs:
        n = max(1, len(accs) // 10)
        last, first = _window_mean(accs[-n:]), _window_mean(accs[:n])
        a2.bar(range(1, len(last) + 1), last, label=f"last {n} steps")
        a2.plot(range(1, len(first) + 1), first, "o--", color="gray", label=f"first {n} steps")
        a2.legend()
    a2.set_xlabel("block position k (predicts anchor + k)")
    a2.set_ylabel("top-1 accuracy")
    a2.set_title("per-position accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
