"""The ResBlock heads Medusa and spark train, in torch, mirroring `speculative.drafters.heads.resblock`: K ResBlocks
y_i = h + silu(W_i·h + b_i), at zero so that each starts as h itself, and one LM head over the draft vocabulary;
and the head folder they are written to and read back from.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np


@cache
def resblock_module() -> type:
    """The torch module class of K ResBlocks and their LM head (defined on first use: torch stays optional).

    ResBlockModule(count, lm_head): `lm_head` [N, H] holds the LM head's first rows (`Corpus.draft_rows`: the
    target's own output rows of the draft vocabulary). forward(h [T, H]) -> logits [K, T, N]. `tensors()` names
    the parameters as the head folder does; a subclass with more parameters adds its own."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class ResBlockModule(nn.Module):
        def __init__(self, count: int, lm_head):
            super().__init__()
            draft_vocab, hidden = lm_head.shape
            self.resblock_weight = nn.Parameter(torch.zeros(count, hidden, hidden))
            self.resblock_bias = nn.Parameter(torch.zeros(count, hidden))
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head)

        def forward(self, h):
            gate = torch.einsum("koh,th->kto", self.resblock_weight, h) + self.resblock_bias[:, None, :]
            return self.lm_head(h[None] + F.silu(gate))

        def tensors(self) -> dict:
            return {
                "resblock.weight": self.resblock_weight,
                "resblock.bias": self.resblock_bias,
                "lm_head.weight": self.lm_head.weight,
            }

    return ResBlockModule


def export_folder(head, draft_ids: list[int], out: Path, meta: dict, card: dict, dtype) -> None:
    """Write the head folder `speculative.drafters.heads.KIND` reads, KIND being meta["kind"]: KIND.safetensors
    (`head.tensors()` in `dtype`, and draft_to_target), KIND.json (`meta`) and training_card.json (`card`)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.ascontiguousarray(t.detach().numpy().astype(dtype)) for name, t in head.tensors().items()}
    arrays["draft_to_target"] = np.asarray(draft_ids, dtype=np.int64)
    save_file(arrays, str(out / f"{meta['kind']}.safetensors"))
    (out / f"{meta['kind']}.json").write_text(json.dumps(meta, indent=2))
    (out / "training_card.json").write_text(json.dumps(card, indent=2))


def import_folder(folder: str | Path, kind: str, make_head) -> tuple[object, np.ndarray]:
    """The inverse of `export_folder`: (the torch head `make_head(KIND.safetensors' arrays)` builds, with those
    arrays' values, in eval mode; draft→target ids)."""
    import torch
    from safetensors.numpy import load_file

    arrays = load_file(str(Path(folder) / f"{kind}.safetensors"))
    head = make_head(arrays)
    with torch.no_grad():
        for name, param in head.tensors().items():
            param.copy_(torch.tensor(arrays[name].astype(np.float32)))
    return head.eval(), arrays["draft_to_target"].astype(np.int64)
