"""PEFT LoRA adapters for tests, made by peft itself on a tiny HF folder, and PEFT's logits as the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_model(base_folder: Path, adapter_folder: Path):
    """HF transformers' model of `base_folder` with the adapter in `adapter_folder` applied by peft (float32)."""
    from peft import PeftModel

    from doppler_py.testing.reference import hf_model

    return PeftModel.from_pretrained(hf_model(base_folder), str(adapter_folder)).eval()


def make_adapter(
    base_folder: Path,
    out: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    modules: tuple[str, ...] = ALL_MODULES,
    rslora: bool = False,
    seed: int = 0,
    spread: float = 0.5,
) -> Path:
    """A random LoRA adapter for the model in `base_folder`, saved by peft into `out` (B drawn too, not zero as a
    fresh adapter's, so the update shows; `spread` keeps it comparable to the base weights' spread)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from doppler_py.testing.reference import hf_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(modules), use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(hf_model(base_folder), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * spread / np.sqrt(param.shape[1]))
    model.save_pretrained(str(out))
    return out


def peft_logits(base_folder: Path, adapter_folder: Path, ids: list[int]) -> np.ndarray:
    """PEFT's logits [T, V] (float64) for one sequence."""
    import torch

    with torch.no_grad():
        return peft_model(base_folder, adapter_folder)(torch.tensor([ids])).logits[0].numpy().astype(np.float64)


def peft_greedy(base_folder: Path, adapter_folder: Path, ids: list[int], steps: int) -> list[int]:
    """PEFT's greedy continuation, each step over the whole sequence again."""
    import torch

    model, seq = peft_model(base_folder, adapter_folder), list(ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]
