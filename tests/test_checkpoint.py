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
