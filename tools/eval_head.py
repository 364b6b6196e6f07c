"""Tokens per target forward of EAGLE heads, simulated in torch on the bench's prompts (no GPU, minutes).

    python tools/eval_head.py --head doppler_py/heads/smollm2-135m-instruct-eagle --head build/eagle --k 4
    python tools/eval_head.py --head doppler_py/heads/smollm2-135m-instruct-eagle --k 1 --frequency-penalty 0.5 \
        --head-penalty-scale 0,1,2   # how a penalty on the head's own rows changes its agreement

For each prompt the target (torch, float32) answers greedily; each head then drafts chains of k tokens over
that answer exactly as the trainer's module does (the target's features for the verified tokens, its own
predicted features after them), and the target accepts the longest matching prefix plus one token of its own.
Greedy speculation never changes the text, so the answer is fixed and only the number of verifying forwards
differs between heads: compare heads here before a long lavapipe run of tools/bench_speculative.py (which
measures speed, and the engine's adaptive draft lengths and trees, that this does not model).

With --frequency-penalty F the target answers under OpenAI's frequency penalty (F times each token's count among
the generated tokens, subtracted from its logit), and each head drafts with F·s times the counts of the tokens
generated and drafted so far subtracted from its rows, for each scale s of --head-penalty-scale (the engine uses
s = 1: a drafter's row i is penalised as the target's row i will be).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_speculative import OPEN_ENDED, PROMPTS


def frequency_penalised(penalty: float, start: int, draft_ids):
    """A head row's frequency penalty: penalty times each draft-vocabulary token's count in tokens[start:]."""
    import torch

    ids = torch.as_tensor(draft_ids)

    def adjust(row, tokens: list[int]):
        counts = torch.bincount(torch.tensor(tokens[start:], dtype=torch.long), minlength=int(ids.max()) + 1)
        return row - penalty * counts[ids].float()

    return adjust


def penalised_greedy(hf, prompt: list[int], tokens: int, penalty: float, stop: list[int]) -> list[int]:
    """The target's greedy answer under a frequency penalty over its generated tokens."""
    import torch
    import transformers

    class Frequency(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            counts = torch.bincount(input_ids[0, len(prompt) :], minlength=scores.shape[-1])[: scores.shape[-1]]
            return scores - penalty * counts.to(scores.dtype)

    processors = transformers.LogitsProcessorList([Frequency()] if penalty else [])
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, logits_processor=processors,
                           eos_token_id=stop, pad_token_id=stop[0])[0].tolist()  # fmt: skip


def simulate(
    head, stats, draft_ids, embed, features, tokens: list[int], start: int, k: int, taps=None, adjust=None
) -> list[int]:
    """Accepted drafts per verifying forward while producing tokens[start:] (chains of k, greedy)."""
    from doppler_py.training.eagle import torch_drafts

    accepted, pos = [], start
    while pos < len(tokens):
        n = min(k, len(tokens) - pos)
        drafts = torch_drafts(head, stats, draft_ids, embed, features, tokens, pos, n, taps, adjust)
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
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="the target's (OpenAI's definition)")
    parser.add_argument("--head-penalty-scale", default="1", help="scales of the heads' row penalty, e.g. 0,1,2")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    from doppler_py.training.data import load_target, target_features
    from doppler_py.training.eagle import import_head

    torch.manual_seed(0)
    hf, tokenizer = load_target(args.model)
    embed = hf.get_input_embeddings().weight.detach()
    heads = {h: import_head(h, hf.config) for h in args.head}
    scales = [float(x) for x in args.head_penalty_scale.split(",")] if args.frequency_penalty else [0.0]
    variants = [(h, s, h if not args.frequency_penalty else f"{h} x{s:g}") for h in heads for s in scales]
    stop = list(tokenizer.eos_token_ids)
    rows = []
    for name, (group, messages) in PROMPTS.items():
        if group != args.group:
            continue
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                  add_special_tokens=False)  # fmt: skip
        out = penalised_greedy(hf, prompt, args.tokens, args.frequency_penalty, stop)
        layers = sorted({layer for _, stats, _ in heads.values() for layer in stats.tap_layers})
        features, _, tapped = target_features(hf, [out], taps=tuple(layers))[0]
        row = {"prompt": name, "new_tokens": len(out) - len(prompt)}
        for h, scale, label in variants:
            head, stats, draft_ids = heads[h]
            taps = tapped[:, [layers.index(t) for t in stats.tap_layers]] if stats.tap_layers else None
            adjust = frequency_penalised(scale * args.frequency_penalty, len(prompt), draft_ids) if scale else None
            accepted = simulate(head, stats, draft_ids, embed, features, out, len(prompt), args.k, taps, adjust)
            depth = [sum(a > i for a in accepted) / max(1, sum(a >= i for a in accepted)) for i in range(args.k)]
            row[label] = {"tok_per_fwd": round(row["new_tokens"] / len(accepted), 3),
                          "per_position_acceptance": [round(d, 3) for d in depth]}  # fmt: skip
        rows.append(row)
        shown = [f"{v}: {row[v]['tok_per_fwd']:.2f} tok/fwd {row[v]['per_position_acceptance']}" for *_, v in variants]
        print(name, "  ".join(shown), flush=True)
    for _, _, label in variants:
        mean = statistics.fmean(r[label]["tok_per_fwd"] for r in rows)
        first = statistics.fmean(r[label]["per_position_acceptance"][0] for r in rows)
        print(f"{label}: mean tok/fwd {mean:.3f}, first draft accepted {first:.3f} (k={args.k})")
    if args.json:
        record = {"k": args.k, "tokens": args.tokens, "frequency_penalty": args.frequency_penalty, "rows": rows}
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
