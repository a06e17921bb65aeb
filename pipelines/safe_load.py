"""Loading DeepSpeed checkpoints without running pickled code.

DeepSpeed writes its ZeRO shards with torch.save and reads them back with
an unrestricted torch.load (weights_only off): a crafted run directory on shared storage would run
arbitrary code in `dflash export` or in a resuming training worker. Inside
`weights_only_loads()` every torch.load is forced to weights_only=True (PyTorch's
TORCH_FORCE_WEIGHTS_ONLY_LOAD switch overrides the callers' False), with an allowlist of
the three plain DeepSpeed types a checkpoint holds beside its tensors. A checkpoint that
needs anything else is refused with an UnsafeCheckpoint naming the file's type, and
nothing it holds runs.
"""

from __future__ import annotations

import importlib
import os
import pickle
from contextlib import contextmanager

# non-tensor types found in DeepSpeed 0.19 ZeRO 1/2/3 checkpoints (fp32 and bf16), all plain
# data: a loss-scaler record, an enum, a namedtuple of ints
DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class UnsafeCheckpoint(ValueError):
    """A checkpoint that cannot be read without unpickling arbitrary objects."""


def _safe_globals() -> list:
    found = []
    for dotted in DEEPSPEED_SAFE_GLOBALS:
        module, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: that type is simply not allowed
            pass
    return found


@contextmanager
def weights_only_loads():
    """Every torch.load inside is weights_only=True (+ the DeepSpeed allowlist); a refused
    load raises UnsafeCheckpoint. Not thread-safe: it sets a process environment variable."""
    import torch

    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            yield
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        detail = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), first)
        raise UnsafeCheckpoint(f"refusing a checkpoint that holds more than tensors and plain data "
                               f"({detail}); only checkpoints written by dflash train load") from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous
