"""pipelines.safe_load: DeepSpeed checkpoints load as tensors and plain data, never as code.

A real ZeRO checkpoint (written by DeepSpeed in a subprocess) consolidates inside
weights_only_loads(); the same directory with one shard replaced by a crafted pickle is
refused, and its payload does not run - while a plain torch.load would have run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelines.safe_load import UnsafeCheckpoint, weights_only_loads

WRITE_CHECKPOINT = """
import os, sys, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": int(sys.argv[2])},
       "gradient_clipping": 1.0}
eng, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3), config=cfg,
                               dist_init_required=False)
eng.backward(eng(torch.randn(1, 8)).sum())
eng.step()
eng.save_checkpoint(sys.argv[1], tag="t")
torch.save({k: v.detach().clone() for k, v in m.state_dict().items()}, sys.argv[1] + "/expected.pt")
"""


class Payload:
    """Unpickling this runs `touch <marker>`: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_checkpoint(path: Path, stage: int) -> None:
    from jobs.demo import free_port

    subprocess.run([sys.executable, "-c", WRITE_CHECKPOINT, str(path), str(stage), str(free_port())],
                   check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_real_zero_checkpoint_consolidates_with_weights_only_loads(tmp_path, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    write_checkpoint(tmp_path / "ck", stage)
    with weights_only_loads():
        state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ck"), tag="t")
    expected = torch.load(tmp_path / "ck" / "expected.pt", weights_only=True)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # restored on the way out


def test_a_crafted_shard_is_refused_and_its_payload_never_runs(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    write_checkpoint(tmp_path / "ck", 2)
    shard = next((tmp_path / "ck" / "t").glob("*optim_states.pt"))
    torch.save({"hook": Payload(tmp_path / "pwned")}, shard)  # the crafted shard replaces the real one

    with pytest.raises(UnsafeCheckpoint, match="refusing a checkpoint"):
        with weights_only_loads():
            get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ck"), tag="t")
    assert not (tmp_path / "pwned").exists()

    run, args = Payload(tmp_path / "pwned").__reduce__()  # what unpickling it would call: a live payload
    run(*args)
    assert (tmp_path / "pwned").exists()
