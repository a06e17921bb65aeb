"""Drafter checkpoints: the public DFlash layout, round trip, and clear errors."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.checkpoint import CheckpointError, load_drafter, read_drafter_config, reference_drafter_dir, \
    resolve_drafter, save_drafter
from dflash.config import DrafterConfig
from dflash.drafter import DFlashDrafter


@pytest.fixture(scope="module")
def drafter(target_fp32):
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target_fp32, num_hidden_layers=2,
                                   num_taps=5)
    return DFlashDrafter(cfg)


def test_layout_is_the_public_dflash_one(tmp_path, drafter, target_fp32):
    save_drafter(drafter, tmp_path, dtype="bf16")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 16 and cfg["num_target_layers"] == 30
    assert cfg["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [1, 8, 14, 20, 27]}
    assert cfg["hidden_size"] == 576 and cfg["num_hidden_layers"] == 2 and "auto_map" not in cfg
    names = set(load_file(str(tmp_path / "model.safetensors")))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        expected |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected  # no embedding, no LM head
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert tensors["fc.weight"].shape == (576, 5 * 576)


def test_round_trip_is_exact_in_fp32(tmp_path, drafter, target_fp32):
    save_drafter(drafter, tmp_path, dtype="fp32")
    loaded = load_drafter(tmp_path, target=target_fp32)
    assert loaded.config == drafter.config
    for (k, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k


def test_decode_block_size_is_kept_and_is_what_decoding_uses(tmp_path, drafter, target_fp32):
    """Trained at B=16, decoded at 4 unless told otherwise; other loaders see block_size."""
    from dflash.decoding import SpeculativeDecoder

    assert SpeculativeDecoder(target_fp32, drafter).block_size == 16
    assert "decode_block_size" not in drafter.config.to_hf_dict()["dflash_ray"]
    short = DFlashDrafter(drafter.config.replace(decode_block_size=4))
    save_drafter(short, tmp_path, dtype="fp32")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["block_size"] == 16 and cfg["dflash_ray"]["decode_block_size"] == 4
    loaded = load_drafter(tmp_path, target=target_fp32)
    assert loaded.config == short.config and loaded.config.extra == {}
    assert SpeculativeDecoder(target_fp32, loaded).block_size == 4
    assert SpeculativeDecoder(target_fp32, loaded, block_size=6).block_size == 6
    for bad in (1, 17):
        with pytest.raises(ValueError, match="decode_block_size"):
            drafter.config.replace(decode_block_size=bad)


def test_drafter_specs_resolve_to_the_shipped_drafter_or_none():
    ref = reference_drafter_dir("default:SmolLM2-135M-Instruct")
    assert ref is not None
    assert resolve_drafter("default", "default:SmolLM2-135M-Instruct") == ref
    assert resolve_drafter("auto", "default:SmolLM2-135M-Instruct") == ref
    assert resolve_drafter("auto", "hf:some-other-model") is None  # autoregressive, not an error
    with pytest.raises(CheckpointError, match="no reference drafter ships for target hf:some-other-model"):
        resolve_drafter("default", "hf:some-other-model")
    for spec in (None, "", "none"):
        assert resolve_drafter(spec, "default:SmolLM2-135M-Instruct") is None
    assert resolve_drafter("runs/d", "x") == Path("runs/d")


def test_missing_keys_are_named(tmp_path, drafter, target_fp32):
    save_drafter(drafter, tmp_path, dtype="fp32")
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_drafter(tmp_path, target=target_fp32)


def test_wrong_hidden_size_and_other_target_are_refused(tmp_path, drafter, target_fp32):
    other = DFlashDrafter(drafter.config.replace(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=16))
    save_drafter(other, tmp_path / "a")
    with pytest.raises(CheckpointError, match="hidden size 64"):
        load_drafter(tmp_path / "a", target=target_fp32)
    made_for_qwen = DFlashDrafter(drafter.config.replace(num_target_layers=36, vocab_size=151936,
                                                         target_layer_ids=(1, 9, 17, 25, 33)))
    save_drafter(made_for_qwen, tmp_path / "b")
    with pytest.raises(CheckpointError, match="36-layer target"):
        load_drafter(tmp_path / "b", target=target_fp32)
    # shapes that disagree with the config are caught even without a target
    save_drafter(drafter, tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["intermediate_size"] = 999
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shapes"):
        load_drafter(tmp_path / "c")


def test_not_a_drafter_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        read_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="not a DFlash drafter"):
        read_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        read_drafter_config(tmp_path)


def test_shipped_reference_drafter_is_small_bf16_and_its_recipe_is_the_reference_config():
    """The committed artifact is what `dflash train --config jobs/configs/reference/train.yaml`
    writes: same step count and training values; bf16 safetensors well under 30 MB."""
    import yaml

    ref = reference_drafter_dir("default:SmolLM2-135M-Instruct")
    assert ref is not None and ref.name == "SmolLM2-135M-Instruct"
    assert (ref / "model.safetensors").stat().st_size < 30e6
    assert json.loads((ref / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype in (torch.bfloat16, torch.int64, torch.int32) for t in load_file(ref / "model.safetensors").values())
    trained = json.loads((ref / "training.json").read_text())
    recipe = yaml.safe_load((Path(__file__).parents[1] / "jobs/configs/reference/train.yaml").read_text())
    assert trained["step"] == recipe["max_steps"]
    for key, value in recipe.items():
        if key not in ("stage", "target", "output_dir", "run_name"):  # where it ran is not the recipe
            assert trained["train_config"][key] == value, key
    log = [json.loads(line) for line in (ref / "training_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == recipe["max_steps"] and "eval_tau" in log[-1]


# --- import: the public z-lab / vLLM layout ------------------------------------------------------

ZLAB_FIELDS = {  # what the public drafters' config.json carry beside the DFlash fields (z-lab, transformers 4.x)
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "bos_token_id": 1, "eos_token_id": 2, "use_cache": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.1", "max_window_layers": 1, "sliding_window": None,
    "layer_types": ["full_attention"], "initializer_range": 0.02, "tie_word_embeddings": False,
}


def public_copy(src: Path, out: Path, keep_vocab: bool = False, head: torch.Tensor | None = None) -> Path:
    """`src` (our layout) as a public drafter would ship it: no private section, the hub's
    config fields; by default the full vocabulary (no d2t, no lm_head) or `head` as lm_head."""
    out.mkdir(parents=True)
    state = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    for k in ("dflash_ray", "dtype"):
        cfg.pop(k)
    if not keep_vocab:
        state.pop("d2t", None), state.pop("lm_head.weight", None), cfg.pop("draft_vocab_size", None)
    if head is not None:
        state["lm_head.weight"] = head.contiguous()
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg | ZLAB_FIELDS))
    return out


@pytest.fixture(scope="module")
def greedy3(target_fp32):
    """Three prompts and transformers' greedy answers to them (fp32, 24 tokens)."""
    from support import CHAT_PROMPTS, chat_prompt_ids, hf_greedy

    prompts = chat_prompt_ids(target_fp32, CHAT_PROMPTS[:3])
    return prompts, [hf_greedy(target_fp32, p, 24) for p in prompts]


def decodes_losslessly(target, drafter, greedy, block=4) -> float:
    from dflash.decoding import SamplingParams, SpeculativeDecoder

    prompts, reference = greedy
    out = SpeculativeDecoder(target, drafter, block_size=block, adaptive=False).generate(prompts, SamplingParams(24))
    assert [r.output_ids for r in out] == reference
    return sum(r.stats.tau for r in out) / len(out)


def test_public_layout_imports_and_decodes_losslessly(tmp_path, target_fp32, greedy3):
    ref = reference_drafter_dir(target_fp32.target_id)
    full = load_drafter(public_copy(ref, tmp_path / "full"), target=target_fp32)
    assert full.config.draft_vocab_size == 0 and full.config.target_id == "" and full.config.extra == {}
    assert decodes_losslessly(target_fp32, full, greedy3) > 1.0  # real weights: some drafts accepted
    # vLLM's reduced vocabulary as another tool wrote it, and a full-vocabulary copy of the target's head
    reduced = load_drafter(public_copy(ref, tmp_path / "reduced", keep_vocab=True), target=target_fp32)
    assert reduced.config.draft_vocab_size == 8192
    decodes_losslessly(target_fp32, reduced, greedy3)
    head = target_fp32.model.lm_head.weight.detach().to(torch.bfloat16)
    with_head = load_drafter(public_copy(ref, tmp_path / "head", head=head), target=target_fp32)
    assert with_head.config.draft_vocab_size == 0
    with pytest.raises(CheckpointError, match="lm_head.weight is not the target's"):
        load_drafter(public_copy(ref, tmp_path / "own_head", head=torch.randn_like(head)), target=target_fp32)


def test_mask_embedding_file_is_read_safely_and_replaces_the_mask_row(tmp_path, target_fp32, greedy3):
    ref = reference_drafter_dir(target_fp32.target_id)
    d = public_copy(ref, tmp_path / "m")
    cfg = read_drafter_config(d)
    emb = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.save(emb, d / "mask_embedding.pt")
    drafter = load_drafter(d, target=target_fp32)
    assert torch.equal(drafter.mask_embedding, emb)
    block = torch.tensor([[7, cfg.mask_token_id, cfg.mask_token_id]])
    x = drafter.embed_block(target_fp32.embed, block)
    assert torch.equal(x[0, 0], target_fp32.embed(block)[0, 0])
    assert torch.equal(x[0, 1], emb) and torch.equal(x[0, 2], emb)
    decodes_losslessly(target_fp32, drafter, greedy3)
    # written back next to the weights, the way vLLM reads it
    save_drafter(drafter, tmp_path / "again", dtype="fp32")
    assert torch.equal(load_drafter(tmp_path / "again").mask_embedding, emb)
    # the dict form names its mask token, which must be the config's
    torch.save({"embedding": emb, "mask_token_id": cfg.mask_token_id}, d / "mask_embedding.pt")
    assert torch.equal(load_drafter(d).mask_embedding, emb)
    torch.save({"embedding": emb, "mask_token_id": cfg.mask_token_id + 1}, d / "mask_embedding.pt")
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_drafter(d)
    torch.save(torch.zeros(3), d / "mask_embedding.pt")
    with pytest.raises(CheckpointError, match=f"expected {cfg.hidden_size} float values"):
        load_drafter(d)
    torch.save({"embedding": emb, "code": Path("x")}, d / "mask_embedding.pt")  # not plain tensors: never unpickled
    with pytest.raises(CheckpointError, match="weights_only"):
        load_drafter(d)


@pytest.mark.parametrize("change, named", [
    ({"my_new_field": 1}, "my_new_field"),
    ({"dflash_config": {"mask_token_id": 16, "target_layer_ids": [1, 8, 14, 20, 27], "noise_schedule": "x"}},
     "noise_schedule"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
])
def test_config_fields_we_cannot_honour_are_errors_that_name_them(tmp_path, drafter, change, named):
    save_drafter(drafter, tmp_path, dtype="fp32")
    cfg = json.loads((tmp_path / "config.json").read_text()) | ZLAB_FIELDS
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    read_drafter_config(tmp_path)  # the hub's bookkeeping fields are fine
    (tmp_path / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(CheckpointError, match=named):
        read_drafter_config(tmp_path)


# --- export formats ------------------------------------------------------------------------------

def test_export_formats(tmp_path, target_fp32):
    from dflash.export_formats import convert_drafter, drafter_layout

    ref = reference_drafter_dir(target_fp32.target_id)
    assert drafter_layout(ref) == "vllm"
    shipped = load_drafter(ref, target=target_fp32)
    # sglang / full: the same drafter over the whole vocabulary, no lm_head, no d2t; the rest travels along
    for fmt in ("sglang", "full"):
        out = convert_drafter(ref, tmp_path / fmt, fmt)
        assert drafter_layout(out) == "full"
        assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(ref / "model.safetensors"))) - {
            "d2t", "lm_head.weight"}
        cfg = json.loads((out / "config.json").read_text())
        assert "draft_vocab_size" not in cfg and cfg["dtype"] == "bfloat16"
        assert (out / "corpus" / "corpus.safetensors").is_file() and (out / "training.json").is_file()
        back = load_drafter(out, target=target_fp32)
        assert back.config == shipped.config.replace(draft_vocab_size=0)
        for k, v in back.state_dict().items():
            assert torch.equal(v, shipped.state_dict()[k]), k
    # vllm from the full one keeps the full vocabulary; from the shipped one, the same tensors
    assert drafter_layout(convert_drafter(tmp_path / "full", tmp_path / "v1", "vllm")) == "full"
    out = convert_drafter(ref, tmp_path / "v2", "vllm")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # in place, and the refusals
    convert_drafter(out, out, "sglang")
    assert drafter_layout(out) == "full" and (out / "corpus" / "corpus.safetensors").is_file()
    with pytest.raises(FileExistsError):
        convert_drafter(ref, tmp_path / "full", "full")
    with pytest.raises(ValueError, match="unknown drafter format 'onnx'"):
        convert_drafter(ref, tmp_path / "x", "onnx")
