"""What doppler-gpu 0.5.1 computes for sliding-window models, as a numpy attention (docs/parity-findings.md).

`doppler_attention` replaces `references.attention` in the numpy forward so that it reproduces the JS
original's logits on Gemma 3 once the context is longer than the window, with its three disagreements:

1. every layer is windowed, full-attention layers included (the attention config built in
   src/inference/pipelines/text/layer.js carries `layerType` but not `layerTypes`, so
   `buildAttentionDispatchParams` in attention/dispatch-params.js takes "no layer types + a window" as
   "every layer slides");
2. a prefill longer than the window clamps the keys of ALL its rows to the prompt's last `window` positions
   (the same function sets kvLenForAttention = window and kvStart = total - window, right for one query row
   only): rows before that see no key at all (their attention output is 0);
3. a decode step past the window scores the values of positions kvStart.. against the keys stored in cache
   rows 0.. (attention_decode.wgsl, `attention_decode`, second pass: `k_offset = key_pos * ...` where the
   first pass uses `get_kv_pos(key_pos)`). Cache rows are positions in a contiguous cache, positions mod the
   window in the ring cache the JS original uses when no layer is full attention.
"""

from __future__ import annotations

import numpy as np

from doppler_py.testing import references

FULL_LAYERS_WINDOWED, PREFILL_CLAMPED, DECODE_KEY_ROWS = "full-layers-windowed", "prefill-clamped", "decode-key-rows"
FINDINGS = (FULL_LAYERS_WINDOWED, PREFILL_CLAMPED, DECODE_KEY_ROWS)


def doppler_attention(prompt_len: int, window: int, ring: bool, findings: tuple[str, ...] = FINDINGS):
    """An attention with `references.attention`'s signature that computes what doppler-gpu computes for a
    sequence whose first `prompt_len` rows were one prefill and whose later rows were single decode steps.
    `findings`: which of the three behaviours to apply (the others are computed as HF computes them), so a
    test can show that each one is needed."""
    reference = references.attention
    size = window

    def stored_position(row: int, positions: list[int]) -> int:
        if not ring:
            return row
        return next(p for p in positions if p % size == row)

    def attend(q, k, v, start_pos, *, window=0, scale=None, softcap=0.0, dtype=np.float64):
        if not window and FULL_LAYERS_WINDOWED not in findings:
            return reference(q, k, v, start_pos, scale=scale, softcap=softcap)
        rows = []
        for i in range(len(q)):
            first = max(0, i + 1 - size)
            value_rows = list(range(first, i + 1))
            key_rows = value_rows
            if i < prompt_len and PREFILL_CLAMPED in findings:
                key_rows = value_rows = [r for r in value_rows if r >= prompt_len - size]
            elif i >= prompt_len and first > 0 and DECODE_KEY_ROWS in findings:
                key_rows = [stored_position(j, value_rows) for j in range(len(value_rows))]
            if not key_rows:
                rows.append(np.zeros((1, q[i].size)))
                continue
            rows.append(
                reference(q[i : i + 1], k[key_rows], v[value_rows], len(key_rows) - 1, scale=scale, softcap=softcap)
            )
        return np.concatenate(rows)

    return attend
