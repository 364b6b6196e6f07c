"""Train an EAGLE head for a target by self-distillation (torch on CPU), in resumable stages
(`doppler_py.training.data`); `out/` becomes the head folder `doppler_py.speculative.drafters.heads.eagle` loads.

Training pairs, for every position p of prompt + answer (teacher forcing through the target):
    input  (f_p standardised, t_{p+1})       f = the target's last-layer output before its final norm
    labels s_{p+1} (the next feature, standardised; smooth L1, weighted `feature_weight`) and the target's
           distribution after t_{p+1} over the draft vocabulary (`soft_targets`: its softmax, renormalised;
           else its argmax, tokens outside the draft vocabulary ignored)
plus `unroll_steps` - 1 unrolled steps ("training-time test", EAGLE-3): from every position a (the anchor) the
head drafts on as it does after a verification. Step j's query sits at position a + j; it reads the pair (the
head's own output of step j - 1 at that anchor, t_{a+j+1}) and attends to the TRUE context's keys at positions
<= a plus its own chain's keys of steps 1..j — exactly what the GPU drafter's KV cache holds at its j-th draft
(`unrolled`). Step j's losses are weighted unroll_weight ** j. The draft vocabulary is the `draft_vocab` most
frequent argmax tokens. With `feature_taps` (EAGLE-3's fusion of low, middle and high layers) the input of a
position the target computed also reads the standardised outputs of those layers through `fc_taps`; a drafted
position's does not (the head's own output is its only feature).

With `init_from` the head continues from a head folder (`import_head`) with that head's draft vocabulary, feature
statistics and taps, and the same hold-out, so sequences it was validated on stay out of training.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from doppler_py.errors import GenerationOptionError, ModelFormatError
from doppler_py.speculative.drafters.heads.files import made_for, read_meta
from doppler_py.training.data import TrainOptions, card, prepare, train_loop


@dataclass
class FeatureStats:
    """Per-dimension statistics that standardise the head's inputs: the target's last-layer feature and, with
    EAGLE-3 fusion, the outputs of the tapped layers ([taps, H] each)."""

    mean: object
    std: object
    tap_layers: tuple[int, ...] = ()
    tap_mean: object = None
    tap_std: object = None

    @classmethod
    def of(cls, corpus, which: list[int], taps: tuple[int, ...]) -> FeatureStats:
        """Statistics of the sequences `which`, of the tapped layers `taps` too (their sums in float64: SmolLM2's
        massive activations reach thousands)."""
        import torch

        feats = torch.cat([corpus.data[i][0] for i in which])
        stats = cls(feats.mean(0), feats.std(0).clamp_min(1e-3))
        if taps:
            total = square = 0.0
            count = 0
            for i in which:
                t = corpus.data[i][2].double()
                total, square, count = total + t.sum(0), square + (t * t).sum(0), count + t.shape[0]
            mean = total / count
            std = ((square - count * mean * mean) / max(1, count - 1)).clamp_min(0).sqrt()
            stats.tap_layers, stats.tap_mean, stats.tap_std = taps, mean.float(), std.float().clamp_min(1e-3)
        return stats

    @property
    def taps(self) -> int:
        return 0 if self.tap_mean is None else int(self.tap_mean.shape[0])

    def features(self, f):
        return (f - self.mean) / self.std

    def tapped(self, t):
        """[T, taps, H] raw outputs → [T, taps·H] standardised; None without taps."""
        if t is None or not self.taps:
            return None
        return ((t.float() - self.tap_mean) / self.tap_std).reshape(t.shape[0], -1)


class EagleHeadModule:
    """The head in torch, mirroring `speculative.drafters.heads.eagle` (built lazily: torch stays optional)."""

    def __new__(cls, target_config, draft_vocab: int, taps: int = 0):
        import torch
        from torch import nn
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        cfg = LlamaConfig(**head_config(target_config, draft_vocab))
        cfg._attn_implementation = "sdpa"  # causal without an explicit mask

        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                h = cfg.hidden_size
                self.config = cfg
                self.fc_embed = nn.Linear(h, h, bias=True)
                self.fc_feature = nn.Linear(h, h, bias=False)
                self.fc_taps = nn.Linear(taps * h, h, bias=False) if taps else None
                self.layer = LlamaDecoderLayer(cfg, 0)
                self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
                self.rotary = LlamaRotaryEmbedding(cfg)
                self.lm_head = nn.Linear(h, draft_vocab, bias=False)

            def forward(self, emb, features, tapped=None):
                x = self.fc_embed(emb) + self.fc_feature(features)
                if tapped is not None:
                    x = x + self.fc_taps(tapped)
                positions = torch.arange(x.shape[1])[None]
                out = self.layer(x, position_embeddings=self.rotary(x, positions), position_ids=positions)
                out = out[0] if isinstance(out, tuple) else out
                return out, self.lm_head(self.norm(out))

        return Head()


def head_config(target_config, draft_vocab: int) -> dict:
    """The head's one-layer LLaMA config (HF names), shaped like the target's layers."""
    t = target_config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": draft_vocab,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.hidden_size // t.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": target_rope_theta(t),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def target_rope_theta(target_config) -> float:
    """The target's RoPE base, which the head's layer takes: transformers 4's `rope_theta`, else transformers 5's
    `rope_parameters`, whose bases Gemma 4 keeps per layer type (the full-attention layers' is taken, as the head
    attends over the whole context)."""
    theta = getattr(target_config, "rope_theta", None)
    if theta:
        return float(theta)
    params = target_config.rope_parameters
    return float(params["full_attention"]["rope_theta"] if "full_attention" in params else params["rope_theta"])


def train(
    model: str | Path,
    out: str | Path,
    work: str | Path,
    options: TrainOptions | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """All stages; returns the training card (also written to out/training_card.json)."""

    options = options or TrainOptions()
    earlier = None
    if options.init_from:
        options, earlier = continued(options)
    corpus = prepare(model, Path(work), options, say)
    hf = corpus.hf
    start = None
    if options.init_from:
        read_meta(Path(options.init_from), "eagle", corpus.hf, corpus.tokenizer)  # refuses another target's head
        start = import_head(options.init_from, hf.config)
        corpus = corpus.with_draft_vocabulary(start[2].tolist())
        say(f"train: continuing {options.init_from} (its {len(corpus.draft_ids)} draft tokens cover "
            f"{corpus.coverage:.3f} of the target's choices here)")  # fmt: skip
    head, stats, sequence_loss = new_head(corpus, options, start)
    embed = hf.get_input_embeddings().weight.detach()
    checkpoint = Path(work) / ("eagle.pt" if start is None else f"eagle-from-{Path(options.init_from).name}.pt")
    steps, losses = train_loop(head, sequence_loss, corpus, checkpoint, options, say)
    top1 = {name: top1_agreement(head, corpus, which, embed, stats) for name, which in
            (("held_in_top1", corpus.train), ("validation_top1", corpus.valid))}  # fmt: skip
    chains = chain_acceptance(head, corpus, corpus.valid, embed, stats, CHAIN_K)
    extra = {} if earlier is None else {"continued_from": earlier}
    record = card("eagle", model, options, corpus, steps, losses, **top1, validation_chains=chains, **extra)
    dtype = np.dtype(options.head_dtype)
    export(head, hf.config, corpus.draft_ids, stats, Path(out), record, corpus.tokenizer, dtype)
    say(f"head written to {out} (top-1 held-in {top1['held_in_top1']:.3f}, validation {top1['validation_top1']:.3f})")
    return record


def continued(options: TrainOptions) -> tuple[TrainOptions, dict]:
    """The options for continuing the head folder `options.init_from` (its feature taps; the same hold-out, so
    its validation sequences stay unseen) and a summary of its training card."""
    folder = Path(options.init_from)
    try:
        meta = json.loads((folder / "eagle.json").read_text())
        earlier = json.loads((folder / "training_card.json").read_text())
        taps, holdout = tuple(meta.get("feature_taps", ())), earlier["options"]["holdout"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelFormatError(
            f"{folder}: --init-from needs an EAGLE head folder with eagle.json and training_card.json ({exc})"
        ) from exc
    if options.feature_taps and tuple(options.feature_taps) != taps:
        raise GenerationOptionError(
            f"--feature-taps {list(options.feature_taps)}: the head in {folder} fuses layers {list(taps)}"
        )
    if holdout != options.holdout:
        raise GenerationOptionError(
            f"{folder} was trained with hold-out {holdout}, this run holds out {options.holdout}: its validation "
            "sequences would be trained on"
        )
    summary = {"head": str(folder), "steps": earlier.get("steps"), "sequences": earlier.get("sequences"),
               "validation_top1": earlier.get("validation_top1")}  # fmt: skip
    return replace(options, feature_taps=taps), summary


def new_head(corpus, options: TrainOptions, start=None):
    """A head for the corpus's target (`start`: (head, stats, draft ids) to continue from `import_head`, else a
    fresh one), the feature statistics it reads and the loss of training sequence i (see the module docstring)."""
    import torch

    hf, data, sequences, to_draft = corpus.hf, corpus.data, corpus.sequences, corpus.to_draft
    embed = hf.get_input_embeddings().weight.detach()
    draft_rows = corpus.draft_rows()
    if start is not None:
        head, stats = start[0].train(), start[1]
    else:
        stats = FeatureStats.of(corpus, corpus.train, tuple(options.feature_taps))
        head = EagleHeadModule(hf.config, len(corpus.draft_ids), stats.taps)
        with torch.no_grad():  # start the draft LM head from the target's own output rows
            head.lm_head.weight.copy_(draft_rows)

    def sequence_loss(i: int):
        ids = torch.tensor(sequences[i])
        f, argmax, tapped = data[i]
        s, tapped = stats.features(f), stats.tapped(tapped)
        emb = embed[ids[1:]]  # t_{p+1} for p = 0..T-2
        if options.soft_targets:  # the target's own distribution after t_{p+1}, from its stored features
            with torch.no_grad():
                targets = torch.softmax(hf.model.norm(f[1:]) @ draft_rows.T, -1)
        else:
            targets = to_draft[argmax[1:]]  # the target's choice after t_{p+1}
        loss = 0.0
        taps_in = None if tapped is None else tapped[:-1]
        for j, (out, logits) in enumerate(unrolled(head, emb, s[:-1], options.unroll_steps, taps_in)):
            step = nn_loss(out, s[1 + j :], logits, targets[j:], options.feature_weight)
            loss = loss + options.unroll_weight**j * step
        return loss

    return head, stats, sequence_loss


def nn_loss(out, s_next, logits, targets, feature_weight: float = 1.0):
    """Feature regression + cross-entropy against hard labels (long, -100 ignored) or soft targets (rows of
    probabilities)."""
    import torch
    import torch.nn.functional as F

    if targets.dtype == torch.long:
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
    else:
        loss = -(targets * F.log_softmax(logits, -1)).sum(-1).mean()
    return loss + feature_weight * F.smooth_l1_loss(out, s_next) if feature_weight else loss


def unrolled(head, emb, s, steps: int, tapped=None) -> list:
    """Training-time test over one sequence: [(out_j, logits_j)] for j < steps, row a of step j being the head's
    j-th draft from anchor a (the head has read the true pairs up to a; rows a = 0 .. n-1-j).

    emb [n, H]: the embedding of t_{p+1} for p < n; s [n, H]: the standardised features f_p. Step 0 is the
    head's ordinary forward. Step j's query at position a + j reads (out_{j-1}[a], t_{a+j+1}) and attends to
    step 0's keys at positions <= a and to its own anchor's keys of steps 1..j, as the drafter's KV cache does.
    tapped [n, taps·H]: the standardised outputs of the tapped layers at p (EAGLE-3 fusion), read by step 0 only:
    a draft's own predicted feature stands for all of them."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer, attn = head.layer, head.layer.self_attn
    n, d = emb.shape[0], attn.head_dim
    heads, kv_heads = head.config.num_attention_heads, head.config.num_key_value_heads

    def project(x, first: int):
        """q, k, v of rows x at positions first, first + 1, ... ([heads, rows, d]; k, v repeated per head)."""
        rows, normed = x.shape[0], layer.input_layernorm(x)
        q = attn.q_proj(normed).view(rows, heads, d).transpose(0, 1)[None]
        k = attn.k_proj(normed).view(rows, kv_heads, d).transpose(0, 1)[None]
        v = attn.v_proj(normed).view(rows, kv_heads, d).transpose(0, 1)
        positions = torch.arange(first, first + rows)[None]
        q, k = apply_rotary_pos_emb(q, k, *head.rotary(x[None], positions))
        repeat = heads // kv_heads
        return q[0], k[0].repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)

    def finish(x, mixed):
        h = x + attn.o_proj(mixed.transpose(0, 1).reshape(x.shape[0], heads * d))
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return out, head.lm_head(head.norm(out))

    x = head.fc_embed(emb) + head.fc_feature(s)
    if tapped is not None:
        x = x + head.fc_taps(tapped)
    q, k0, v0 = project(x, 0)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = (q @ k0.transpose(1, 2)) * attn.scaling
    out, logits = finish(x, torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v0)
    results, chain = [(out, logits)], []  # chain: (k, v) of steps 1..j per anchor
    for j in range(1, steps):
        m = n - j  # anchors with a token t_{a+j+1} to read
        if m <= 0:
            break
        x = head.fc_embed(emb[j:]) + head.fc_feature(out[:m])
        q, k, v = project(x, j)  # anchor a's step-j row sits at position a + j
        chain = [(ck[:, :m], cv[:, :m]) for ck, cv in chain] + [(k, v)]
        context = ((q @ k0.transpose(1, 2)) * attn.scaling).masked_fill(~causal[:m], float("-inf"))
        own = torch.stack([(q * ck).sum(-1) for ck, _ in chain], -1) * attn.scaling  # [heads, m, j]
        weights = torch.softmax(torch.cat([context, own], -1), -1)
        mixed = weights[..., :n] @ v0 + (weights[..., n:, None] * torch.stack([cv for _, cv in chain], 2)).sum(2)
        out, logits = finish(x, mixed)
        results.append((out, logits))
    return results


def top1_agreement(head, corpus, which: list[int], embed, stats: FeatureStats) -> float:
    """How often the head's first draft equals the target's next choice at the answer positions of the
    sequences `which` (where drafting happens; the prompt's chat template would flatter the figure)."""
    import torch

    hits = total = 0
    with torch.no_grad():
        for i in which:
            (f, argmax, tapped), ids = corpus.data[i], torch.tensor(corpus.sequences[i])
            tapped = stats.tapped(tapped)
            tapped = None if tapped is None else tapped[:-1][None]
            _, logits = head(embed[ids[1:]][None], stats.features(f)[:-1][None], tapped)
            labels = corpus.to_draft[argmax[1:]]
            kept = corpus.answer_positions(i, labels.numel())
            hits += int((logits[0].argmax(-1)[kept] == labels[kept]).sum())
            total += int(kept.sum())
    return hits / max(1, total)


CHAIN_K = 4  # the chain length of the training card's validation figures


def chain_acceptance(head, corpus, which: list[int], embed, stats: FeatureStats, k: int) -> dict:
    """Greedy chains of k drafts from every answer position of the sequences `which` whose next k + 1 tokens are
    the target's own choices (a greedy answer's): the share of chains still accepted at each depth, and the
    tokens per target forward if every verification ended at such a position (accepted + 1)."""
    import torch

    reached, anchors = [0] * k, 0  # reached[j]: chains with drafts 0..j all accepted
    with torch.no_grad():
        for i in which:
            (f, argmax, tapped), ids = corpus.data[i], torch.tensor(corpus.sequences[i])
            tapped = stats.tapped(tapped)
            rows = unrolled(head, embed[ids[1:]], stats.features(f)[:-1], k, None if tapped is None else tapped[:-1])
            n = len(rows[-1][1])  # anchors with all k steps
            if n <= 0:
                continue
            labels = corpus.to_draft[argmax[1:]]
            greedy = ids[2:] == argmax[1:-1]  # greedy[p]: t_{p+2} is the target's choice after t_{p+1}
            hits = torch.stack([rows[j][1][:n].argmax(-1) == labels[j : j + n] for j in range(k)], 1)
            fed = torch.ones(n, dtype=torch.bool)  # step j reads t_{a+j+1}: was it the target's own choice?
            for j in range(1, k):
                fed &= greedy[j - 1 : j - 1 + n]
            keep = corpus.answer_positions(i, n) & fed
            depth = hits[keep].int().cumprod(1)  # depth[a, j]: drafts 0..j all accepted
            reached = [r + int(c) for r, c in zip(reached, depth.sum(0).tolist(), strict=True)]
            anchors += int(keep.sum())
    return {
        "k": k,
        "anchors": anchors,
        "accepted_by_depth": [round(r / max(1, anchors), 4) for r in reached],
        "tokens_per_forward": round(1 + sum(reached) / max(1, anchors), 4),
    }


def torch_drafts(
    head,
    stats: FeatureStats,
    draft_ids,
    embed,
    features,
    tokens: list[int],
    committed: int,
    n: int,
    taps=None,
    adjust: Callable[[object, list[int]], object] | None = None,
) -> list[int]:
    """The n tokens the torch head drafts after tokens[:committed] (greedy), as the GPU drafter does: the pairs
    (f_p, t_{p+1}) for p < committed - 1 from the target's `features` (raw, [T, H]) and tapped layers' outputs
    (raw, [T, taps, H]), then its own predicted features for the tokens it drafted (no taps there). `adjust`,
    given the head's row (logits over the draft vocabulary) and the tokens so far (committed, then drafted),
    returns the row to pick from: the target's penalties, as the GPU drafter applies them to its rows."""
    import torch

    feats, ids, out = stats.features(features[: committed - 1]), list(tokens[1:committed]), []
    tapped = stats.tapped(None if taps is None else taps[: committed - 1])
    with torch.no_grad():
        for _ in range(n):
            pred, logits = head(embed[torch.tensor(ids)][None], feats[None], None if tapped is None else tapped[None])
            row = logits[0, -1] if adjust is None else adjust(logits[0, -1], [*tokens[:committed], *out])
            out.append(int(draft_ids[int(row.argmax())]))
            feats, ids = torch.cat([feats, pred[0, -1:]]), [*ids, out[-1]]
            if tapped is not None:  # a drafted position has no target layers: its tapped input is zero
                tapped = torch.cat([tapped, tapped.new_zeros(1, tapped.shape[1])])
    return out


def export(
    head,
    target_config,
    draft_ids: list[int],
    stats: FeatureStats,
    out: Path,
    card: dict,
    tokenizer=None,
    dtype=np.float32,
) -> None:
    """Write the head folder `doppler_py.speculative.drafters.heads.eagle.load_head` reads."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().numpy().astype(dtype) for k, v in head.state_dict().items() if "rotary" not in k}
    lm = sd["lm_head.weight"]
    model = {"model.embed_tokens.weight": lm, "model.norm.weight": sd["norm.weight"]}
    model |= {f"model.layers.0.{k[len('layer.') :]}": v for k, v in sd.items() if k.startswith("layer.")}
    save_file({k: np.ascontiguousarray(v) for k, v in model.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    eagle = {
        "fc_embed.weight": sd["fc_embed.weight"],
        "fc_embed.bias": sd["fc_embed.bias"],
        "fc_feature.weight": sd["fc_feature.weight"],
        "feature_mean": stats.mean.numpy().astype(np.float32),  # f32 always: |μ| reaches thousands on SmolLM2
        "feature_std": stats.std.numpy().astype(np.float32),
        "draft_to_target": np.asarray(draft_ids, dtype=np.int64),
    }
    if stats.taps:
        eagle |= {
            "fc_taps.weight": sd["fc_taps.weight"],
            "tap_mean": stats.tap_mean.numpy().astype(np.float32),
            "tap_std": stats.tap_std.numpy().astype(np.float32),
        }
    save_file({k: np.ascontiguousarray(v) for k, v in eagle.items()}, str(out / "eagle.safetensors"))
    config = head_config(target_config, len(draft_ids)) | {"torch_dtype": np.dtype(dtype).name}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    meta = {
        "kind": "eagle",
        "target": made_for(target_config, tokenizer),
        "draft_vocab": len(draft_ids),
        "feature_taps": list(stats.tap_layers),
    }
    (out / "eagle.json").write_text(json.dumps(meta, indent=2))
    (out / "training_card.json").write_text(json.dumps(card, indent=2))


def import_head(folder: str | Path, target_config):
    """The inverse of `export`: (torch head, its feature statistics, draft→target ids) from a head folder."""
    import torch
    from safetensors.numpy import load_file

    folder = Path(folder)
    eagle, model = load_file(str(folder / "eagle.safetensors")), load_file(str(folder / "model.safetensors"))
    taps = int(eagle["tap_mean"].shape[0]) if "tap_mean" in eagle else 0
    head = EagleHeadModule(target_config, int(eagle["draft_to_target"].size), taps)
    names = ("fc_embed.weight", "fc_embed.bias", "fc_feature.weight") + (("fc_taps.weight",) if taps else ())
    state = {name: eagle[name] for name in names}
    state |= {"norm.weight": model["model.norm.weight"], "lm_head.weight": model["model.embed_tokens.weight"]}
    prefix = "model.layers.0."
    state |= {"layer." + k[len(prefix) :]: v for k, v in model.items() if k.startswith(prefix)}
    missing, unexpected = head.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    if unexpected or any(not k.startswith("rotary") for k in missing):
        raise ValueError(f"{folder}: head tensors missing {missing} or unexpected {unexpected}")
    stats = FeatureStats(torch.tensor(eagle["feature_mean"]), torch.tensor(eagle["feature_std"]))
    if taps:
        stats.tap_mean, stats.tap_std = torch.tensor(eagle["tap_mean"]), torch.tensor(eagle["tap_std"])
        stats.tap_layers = tuple(json.loads((folder / "eagle.json").read_text())["feature_taps"])
    return head.eval(), stats, eagle["draft_to_target"].astype(np.int64)
