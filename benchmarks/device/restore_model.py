"""On the GPU machine: restores the float32 MiniLM weights from ``.gpu/model16`` into /tmp/minilm_model (the
weights are rounded to float16 once: timings are unaffected, embeddings differ in the 4th digit)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

source, target = Path(".gpu/model16"), Path("/tmp/minilm_model")
shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model16.safetensors"))
weights = load_file(source / "model16.safetensors")
save_file(
    {k: (v.float() if v.dtype == torch.float16 else v).contiguous() for k, v in weights.items()},
    target / "model.safetensors",
)
print("model restored at", target)
