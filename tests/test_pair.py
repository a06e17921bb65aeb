"""dflash.pair: one config and one loader for the decoding pair, used by every entry point."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from dflash.checkpoint import CheckpointError, reference_drafter_dir, save_drafter
from dflash.config import DrafterConfig
from dflash.drafter import DFlashDrafter
from dflash.pair import DecodeConfig, check_pair, load_pair
from dflash.target import default_cache_dir, inspect_target, resolve_target_dir
from jobs.cli import main as cli
from jobs.demo import DemoConfig
from serve.config import ServeConfig


@pytest.mark.parametrize("changes, message", [
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"verify": "maybe"}, "verify must be one of"),
    ({"block_size": 1}, "block_size must be 0"),
    ({"lookup_tokens": 0}, "lookup_tokens must be >= 1"),
    ({"tree_nodes": 1}, "tree_nodes must be 0"),
    ({"device": "tpu"}, "device must be"),
    ({"speculation_margin": -0.1}, "speculation_margin must be in"),
])
def test_decode_config_refuses_bad_values_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**changes)


def test_serve_and_demo_configs_embed_every_decoding_field():
    """A new decoding option is one DecodeConfig field; serving and the demo get it for free."""
    names = {f.name for f in fields(DecodeConfig)}
    assert names <= {f.name for f in fields(ServeConfig)}
    assert names <= {f.name for f in fields(DemoConfig)}
    demo = DemoConfig(lookup=False, lookup_tokens=3, corpus="none", block_size=2)
    decode = DecodeConfig.of(demo, drafter="somewhere")
    assert (decode.lookup, decode.lookup_tokens, decode.corpus, decode.block_size, decode.drafter) == \
        (False, 3, "none", 2, "somewhere")


def test_load_pair_builds_the_shipped_pair_with_its_block_lookup_and_corpus(target_fp32):
    pair = load_pair(DecodeConfig(drafter="default", dtype="fp32"), target=target_fp32)
    ref = reference_drafter_dir(target_fp32.target_id)
    assert pair.drafter_source == str(ref)
    assert pair.decoder.block_size == pair.drafter.config.decode_block_size == 4
    assert pair.decoder.lookup.num_tokens == 7 and pair.decoder.corpus.num_tokens == 7
    assert pair.corpus_source == str(ref / "corpus" / "corpus.safetensors")
    plain = load_pair(DecodeConfig(drafter="default", dtype="fp32", lookup=False, corpus="none", block_size=8),
                      target=target_fp32)
    assert plain.decoder.block_size == 8 and plain.decoder.lookup is None and plain.decoder.corpus is None
    assert load_pair(DecodeConfig(drafter="none", dtype="fp32"), target=target_fp32).drafter is None
    # the adaptive width's margin is the config's (default 0.1)
    assert pair.decoder.policy.margin == 0.1
    assert load_pair(DecodeConfig(drafter="default", dtype="fp32", speculation_margin=0.0),
                     target=target_fp32).decoder.policy.margin == 0.0
    with pytest.raises(ValueError, match="config asks for bf16"):
        load_pair(DecodeConfig(drafter="none", dtype="bf16"), target=target_fp32)


def test_a_decode_block_past_the_trained_block_is_refused(target_fp32, capsys):
    """Positions past the trained block would be drafted by untrained slots: refused before
    any decoding, by the loader, the pre-start check and the command line alike."""
    cfg = DecodeConfig(drafter="default", dtype="fp32", block_size=9)
    with pytest.raises(ValueError, match=r"in 2\.\.8, got 9"):
        load_pair(cfg, target=target_fp32)
    with pytest.raises(CheckpointError, match=r"in 2\.\.8, got 9"):
        check_pair(cfg)
    assert cli(["generate", "--prompt", "hi", "--dtype", "fp32", "--block-size", "9"]) == 2
    assert "in 2..8, got 9" in capsys.readouterr().err


def test_check_pair_refuses_a_drafter_made_for_another_target(target_fp32, tmp_path):
    cfg = DrafterConfig.for_target(target_fp32, num_taps=2, block_size=4)
    wrong = cfg.replace(num_target_layers=cfg.num_target_layers + 2)
    save_drafter(DFlashDrafter(wrong), tmp_path / "wrong", dtype="fp32")
    with pytest.raises(CheckpointError, match="made for a 32-layer target"):
        check_pair(DecodeConfig(drafter=str(tmp_path / "wrong")))
    check_pair(DecodeConfig(drafter=str(tmp_path / "missing")))  # not on this machine: the replica checks
    check_pair(DecodeConfig(drafter="none"))


def test_dflash_cache_moves_the_cache_for_every_stage(tmp_path, monkeypatch):
    """$DFLASH_CACHE is read in one place (dflash.target.default_cache_dir), which distill,
    train, serve, the demo and the CLI all reach through inspect_target/load_target."""
    model_dir, _ = resolve_target_dir("default")  # the conversion the test run already has
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    (tmp_path / "cache" / "targets").mkdir(parents=True)
    (tmp_path / "cache" / "targets" / model_dir.name).symlink_to(model_dir)  # no second 20 s conversion
    info = inspect_target("default")
    assert Path(info.model_dir).parent == tmp_path / "cache" / "targets"
    assert info.num_layers == 30 and info.weights_hash


def test_dtype_auto_is_bf16_only_where_the_cpu_computes_it_natively():
    """Without AVX512-BF16/AMX a 4-token bf16 verify costs ~2.4 AR steps (emulated), so auto
    must pick fp32 there; with them, bf16. Explicit dtypes are kept."""
    from dflash.pair import cpu_has_native_bf16, resolve_dtype

    sapphire = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    skylake = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\n"
    assert cpu_has_native_bf16(sapphire) and not cpu_has_native_bf16(skylake)
    assert resolve_dtype("auto", "cpu", sapphire)[0] == "bf16"
    dtype, why = resolve_dtype("auto", "cpu", skylake)
    assert dtype == "fp32" and "no native bf16" in why
    assert resolve_dtype("bf16", "cpu", skylake) == ("bf16", "asked for")
    assert resolve_dtype("fp32", "cpu", sapphire) == ("fp32", "asked for")
