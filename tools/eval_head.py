"""Tokens per target forward of EAGLE heads, simulated in torch on the bench's prompts (no GPU, minutes).

    python tools/eval_head.py --head doppler_py/heads/smollm2-135m-instruct-eagle --head build/eagle --k 4

For each prompt the target (torch, float32) answers greedily; each head then drafts chains of k tokens over
that answer exactly as the trainer's module does (the target's features for the verified tokens, its own
predicted features after them), and the target accepts the longest matching prefix plus one token of its own.
Greedy speculation never changes the text, so the answer is fixed and only the number of verifying forwards
differs between heads: compare heads here before a long lavapipe run of tools/bench_speculative.py (which
measures speed, and the engine's adaptive draft lengths and trees, that this does not model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_speculative import OPEN_ENDED, PROMPTS


def simulate(head, stats, draft_ids, embed, features, tokens: list[int], start: int, k: int, taps=None) -> list[int]:
    """Accepted drafts per verifying forward while producing tokens[start:] (chains of k, greedy)."""
    from doppler_py.training.eagle import torch_drafts

    accepted, pos = [], start
    while pos < len(tokens):
        n = min(k, len(tokens) - pos)
        drafts = torch_drafts(head, stats, draft_ids, embed, features, tokens, pos, n, taps)
        a = next((i for i, t in enumerate(drafts) if t != tokens[pos + i]), len(drafts))
        accepted.append(a)
        pos += a + 1
    return accepted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--head", action="append", required=True, help="an EAGLE head folder (repeatable)")
    parser.add_argument("--group", default=OPEN_ENDED, help=f"prompt group of bench_speculative (default {OPEN_ENDED})")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    from doppler_py.training.data import load_target, target_features
    from doppler_py.training.eagle import import_head

    torch.manual_seed(0)
    hf, tokenizer = load_target(args.model)
    embed = hf.get_input_embeddings().weight.detach()
    heads = {h: import_head(h, hf.config) for h in args.head}
    stop = list(tokenizer.eos_token_ids)
    rows = []
    for name, (group, messages) in PROMPTS.items():
        if group != args.group:
            continue
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                  add_special_tokens=False)  # fmt: skip
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=args.tokens, do_sample=False,
                              eos_token_id=stop, pad_token_id=stop[0])[0].tolist()  # fmt: skip
        layers = sorted({layer for _, stats, _ in heads.values() for layer in stats.tap_layers})
        features, _, tapped = target_features(hf, [out], taps=tuple(layers))[0]
        row = {"prompt": name, "new_tokens": len(out) - len(prompt)}
        for h, (head, stats, draft_ids) in heads.items():
            taps = tapped[:, [layers.index(t) for t in stats.tap_layers]] if stats.tap_layers else None
            accepted = simulate(head, stats, draft_ids, embed, features, out, len(prompt), args.k, taps)
            depth = [sum(a > i for a in accepted) / max(1, sum(a >= i for a in accepted)) for i in range(args.k)]
            row[h] = {"tok_per_fwd": round(row["new_tokens"] / len(accepted), 3),
                      "per_position_acceptance": [round(d, 3) for d in depth]}  # fmt: skip
        rows.append(row)
        print(name, "  ".join(f"{h}: {row[h]['tok_per_fwd']:.2f} tok/fwd {row[h]['per_position_acceptance']}"
                              for h in heads), flush=True)  # fmt: skip
    for h in heads:
        print(f"{h}: mean tok/fwd {statistics.fmean(r[h]['tok_per_fwd'] for r in rows):.3f} (k={args.k})")
    if args.json:
        args.json.write_text(json.dumps({"k": args.k, "tokens": args.tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
