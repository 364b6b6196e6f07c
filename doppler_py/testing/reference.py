"""HF transformers (torch, CPU) as the reference implementation for model-level tests and benchmarks.

torch and transformers are test-only dependencies (`pip install -e .[test,reference]`); importing this module
without them raises ImportError at call time, which tests turn into a skip locally and a failure in CI.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def hf_model(folder: str | Path, gguf_file: str | None = None):
    import torch
    import transformers

    kwargs = {"dtype": torch.float32}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    model.eval()
    return model


def hf_logits(folder: str | Path, ids: list[int]) -> np.ndarray:
    """Logits [T, V] (float64) of HF transformers in float32 for one sequence."""
    import torch

    model = hf_model(folder)
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return out.logits[0].numpy().astype(np.float64)
