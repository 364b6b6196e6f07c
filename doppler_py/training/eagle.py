"""Train an EAGLE head for a target by self-distillation (torch on CPU), in resumable stages.

    work/prompts.jsonl   seed instructions (seed_prompts.txt) + questions the target writes itself (Magpie:
                         the chat template's user prefix, sampled until the end of the turn)
    work/answers.jsonl   the target's answers (greedy; every `sampled_every`th batch sampled at T = 0.7), appended a
                         batch at a time (a restart skips what is there)
    work/checkpoint.pt   the head and optimiser every `save_every` steps (a restart resumes from it)
    out/                 the head folder `doppler_py.speculative.eagle` loads, with training_card.json

Training pairs, for every position p of prompt + answer (teacher forcing through the target):
    input  (f_p standardised, t_{p+1})       f = the target's last-layer output before its final norm
    labels s_{p+1} (the next feature, standardised; smooth L1) and the target's own argmax at p+1 mapped to
           the draft vocabulary (cross-entropy; tokens outside it are ignored)
plus one unrolled step ("training-time test"): the head's own outputs replace the features, as in drafting,
with its losses weighted 0.8. The draft vocabulary is the `draft_vocab` most frequent argmax tokens.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from doppler_py.speculative.eagle import vocabulary_digest

SEED_PROMPTS = Path(__file__).with_name("seed_prompts.txt")


@dataclass(frozen=True)
class TrainOptions:
    magpie_prompts: int = 0  # questions the target writes itself, on top of the seed list
    seed_prompts: int | None = None  # how many seed instructions to use (None: all)
    max_new_tokens: int = 128
    answer_batch: int = 8  # prompts answered together (left-padded)
    sampled_every: int = 4  # every Nth batch is answered by sampling at T = 0.7 (the rest greedily); 0: never
    draft_vocab: int = 8192
    steps: int = 1500
    lr: float = 1e-3
    sequences_per_step: int = 4
    unroll_weight: float = 0.8
    save_every: int = 200
    head_dtype: str = "float16"  # the exported weights (feature statistics stay float32)
    seed: int = 0


def load_target(model: str | Path):
    """(torch model, Tokenizer) for a known model name, an HF folder with float weights, or a .gguf file."""
    import torch
    import transformers

    from doppler_py.model.catalog import resolve_model
    from doppler_py.tokenizer import Tokenizer

    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        folder, gguf = path, None
    else:
        if path.suffix != ".gguf":
            from doppler_py.model.catalog import known_model_file

            path = known_model_file(str(model))
        folder, gguf = path.parent, path.name
    kwargs = {"dtype": torch.float32} | ({"gguf_file": gguf} if gguf else {})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
    tokenizer_dir = folder if gguf is None else resolve_model(str(model), "keep", progress=False)
    return hf, Tokenizer.from_dir(tokenizer_dir)


def _append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def make_prompts(hf, tokenizer, work: Path, options: TrainOptions, say: Callable[[str], None]) -> list[str]:
    """Stage 1: the seed list plus Magpie questions (resumable)."""
    import torch

    path = work / "prompts.jsonl"
    have = _read_jsonl(path)
    if not have:
        seeds = [line.strip() for line in SEED_PROMPTS.read_text().splitlines() if line.strip()]
        for text in seeds[: options.seed_prompts]:
            _append_jsonl(path, {"source": "seed", "prompt": text})
        have = _read_jsonl(path)
    written = sum(1 for r in have if r["source"] == "magpie")
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], add_generation_prompt=False)
    prefix = prefix[: prefix.index("\x00")]  # the template up to where the user's words go
    prefix_ids = torch.tensor([tokenizer.encode(prefix, add_special_tokens=False)])
    stop = list(tokenizer.eos_token_ids)
    start = time.perf_counter()
    while written < options.magpie_prompts:
        torch.manual_seed(options.seed + written)  # a restart continues the same sequence of questions
        n = min(options.answer_batch, options.magpie_prompts - written)
        with torch.no_grad():
            out = hf.generate(prefix_ids, max_new_tokens=48, do_sample=True, temperature=1.0, top_p=0.95,
                              num_return_sequences=n, eos_token_id=stop,
                              pad_token_id=stop[0] if stop else 0)  # fmt: skip
        for row in out[:, prefix_ids.shape[1] :].tolist():
            text = tokenizer.decode(row, skip_special_tokens=True).strip()
            if len(text) >= 8 and written < options.magpie_prompts:
                _append_jsonl(path, {"source": "magpie", "prompt": text})
                written += 1
        say(f"prompts: {written}/{options.magpie_prompts} written by the target ({time.perf_counter() - start:.0f} s)")
    return [r["prompt"] for r in _read_jsonl(path)]


def make_answers(hf, tokenizer, prompts: list[str], work: Path, options: TrainOptions, say) -> list[list[int]]:
    """Stage 2: prompt + answer token ids per prompt (resumable; a batch at a time, left-padded)."""
    import torch

    path = work / "answers.jsonl"
    done = len(_read_jsonl(path))
    stop = list(tokenizer.eos_token_ids)
    pad = stop[0] if stop else 0
    start, tokens = time.perf_counter(), 0
    for first in range(done, len(prompts), options.answer_batch):
        batch = []
        for prompt in prompts[first : first + options.answer_batch]:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            batch.append(tokenizer.encode(text, add_special_tokens=False))
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        number = first // options.answer_batch
        sampled = options.sampled_every > 0 and number % options.sampled_every == options.sampled_every - 1
        torch.manual_seed(options.seed + number)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=options.max_new_tokens, do_sample=sampled,
                              temperature=0.7 if sampled else None, top_p=None, top_k=None,
                              eos_token_id=stop, pad_token_id=pad)  # fmt: skip
        for prompt_ids, row in zip(batch, out[:, width:].tolist(), strict=True):
            answer = next(([*row[: i + 1]] for i, t in enumerate(row) if t in stop), row)  # up to the first stop
            tokens += len(answer)
            _append_jsonl(path, {"prompt_ids": prompt_ids, "answer_ids": answer})
        rate = tokens / max(1e-9, time.perf_counter() - start)
        say(f"answers: {first + len(batch)}/{len(prompts)} ({tokens} tokens, {rate:.0f} tokens/s)")
    return [r["prompt_ids"] + r["answer_ids"] for r in _read_jsonl(path)]


def target_features(hf, sequences: list[list[int]]):
    """Per sequence: (features [T, H] before the final norm, the target's argmax [T])."""
    import torch

    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.update(x=out[0] if isinstance(out, tuple) else out)
    )
    data = []
    try:
        with torch.no_grad():
            for ids in sequences:
                logits = hf(torch.tensor([ids])).logits[0]
                data.append((captured["x"][0].float().clone(), logits.argmax(-1)))
    finally:
        hook.remove()
    return data


class EagleHeadModule:
    """The head in torch, mirroring `doppler_py.speculative.eagle` (built lazily so torch stays optional)."""

    def __new__(cls, target_config, draft_vocab: int):
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
                self.layer = LlamaDecoderLayer(cfg, 0)
                self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
                self.rotary = LlamaRotaryEmbedding(cfg)
                self.lm_head = nn.Linear(h, draft_vocab, bias=False)

            def forward(self, emb, features):
                x = self.fc_embed(emb) + self.fc_feature(features)
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
        "rope_theta": getattr(t, "rope_theta", None) or t.rope_parameters["rope_theta"],
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def train(
    model: str | Path,
    out: str | Path,
    work: str | Path,
    options: TrainOptions = TrainOptions(),
    say: Callable[[str], None] = print,
) -> dict:
    """All stages; returns the training card (also written to out/training_card.json)."""
    import torch

    out, work = Path(out), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    hf, tokenizer = load_target(model)
    torch.manual_seed(options.seed)
    prompts = make_prompts(hf, tokenizer, work, options, say)
    times["prompts_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sequences = make_answers(hf, tokenizer, prompts, work, options, say)
    times["answers_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = target_features(hf, sequences)
    feats = torch.cat([f for f, _ in data])
    mean, std = feats.mean(0), feats.std(0).clamp_min(1e-3)
    counts = Counter(int(t) for _, argmax in data for t in argmax.tolist())
    vocab = min(options.draft_vocab, hf.config.vocab_size)
    draft_ids = [t for t, _ in counts.most_common(vocab)]
    vocab = len(draft_ids)
    to_draft = torch.full((hf.config.vocab_size,), -100, dtype=torch.long)
    to_draft[torch.tensor(draft_ids)] = torch.arange(vocab)
    embed = hf.get_input_embeddings().weight.detach()
    times["features_s"] = time.perf_counter() - t0

    head = EagleHeadModule(hf.config, vocab)
    with torch.no_grad():  # start the draft LM head from the target's own output rows
        head.lm_head.weight.copy_(hf.get_output_embeddings().weight.detach()[torch.tensor(draft_ids)])
    opt = torch.optim.AdamW(head.parameters(), lr=options.lr)
    checkpoint = work / "checkpoint.pt"
    step, losses = 0, []
    if checkpoint.is_file():
        state = torch.load(checkpoint)
        if state["draft_ids"] == draft_ids:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            step, losses = state["step"], state["losses"]
            say(f"train: resumed at step {step}")
    gen = torch.Generator().manual_seed(options.seed + step)
    t0 = time.perf_counter()
    while step < options.steps:
        lr = options.lr * 0.5 * (1 + math.cos(math.pi * step / options.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        picks = torch.randint(len(data), (options.sequences_per_step,), generator=gen).tolist()
        total = torch.zeros(())
        for i in picks:
            ids = torch.tensor(sequences[i])
            f, argmax = data[i]
            s = (f - mean) / std
            emb = embed[ids[1:]][None]  # t_{p+1} for p = 0..T-2
            labels = to_draft[argmax[1:]]  # the target's choice after t_{p+1}
            pred, logits = head(emb, s[:-1][None])
            loss = nn_loss(pred[0], s[1:], logits[0], labels)
            # Training-time test: the head's own predictions as the next pairs' features (one unrolled step).
            pred2, logits2 = head(emb[:, 1:], pred[:, :-1])
            loss = loss + options.unroll_weight * nn_loss(pred2[0], s[2:], logits2[0], labels[1:])
            total = total + loss / len(picks)
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(float(total.detach()))
        if step % 50 == 0 or step == options.steps:
            say(
                f"train: step {step}/{options.steps} loss {np.mean(losses[-50:]):.3f} "
                f"({time.perf_counter() - t0:.0f} s)"
            )
        if step % options.save_every == 0 or step == options.steps:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "losses": losses,
                        "draft_ids": draft_ids}, checkpoint)  # fmt: skip
    times["train_s"] = time.perf_counter() - t0
    top1 = held_in_top1(head, data, sequences, embed, mean, std, to_draft)
    card = {
        "kind": "eagle",
        "target": str(model),
        "options": asdict(options),
        "prompts": len(prompts),
        "sequences": len(sequences),
        "tokens": int(sum(len(s) for s in sequences)),
        "draft_vocab": vocab,
        "draft_vocab_coverage": sum(counts[t] for t in draft_ids) / max(1, sum(counts.values())),
        "steps": step,
        "final_loss": float(np.mean(losses[-50:])) if losses else None,
        "held_in_top1": top1,
        "wall_time_s": {k: round(v, 1) for k, v in times.items()},
    }
    export(head, hf.config, draft_ids, mean, std, out, card, tokenizer, np.dtype(options.head_dtype))
    say(f"head written to {out} (held-in top-1 {top1:.3f})")
    return card


def nn_loss(out, s_next, logits, labels):
    import torch.nn.functional as F

    return F.smooth_l1_loss(out, s_next) + F.cross_entropy(logits, labels, ignore_index=-100)


def held_in_top1(head, data, sequences, embed, mean, std, to_draft) -> float:
    """How often the head's first draft equals the target's next token on the training sequences."""
    import torch

    hits = total = 0
    with torch.no_grad():
        for (f, argmax), seq in zip(data, sequences, strict=True):
            ids = torch.tensor(seq)
            _, logits = head(embed[ids[1:]][None], ((f - mean) / std)[:-1][None])
            labels = to_draft[argmax[1:]]
            kept = labels >= 0
            hits += int((logits[0].argmax(-1)[kept] == labels[kept]).sum())
            total += int(labels.numel())
    return hits / max(1, total)


def export(
    head, target_config, draft_ids: list[int], mean, std, out: Path, card: dict, tokenizer=None, dtype=np.float32
) -> None:
    """Write the head folder `doppler_py.speculative.eagle.load_head` reads."""
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
        "feature_mean": mean.numpy().astype(np.float32),  # f32 always: |μ| reaches thousands on SmolLM2
        "feature_std": std.numpy().astype(np.float32),
        "draft_to_target": np.asarray(draft_ids, dtype=np.int64),
    }
    save_file({k: np.ascontiguousarray(v) for k, v in eagle.items()}, str(out / "eagle.safetensors"))
    config = head_config(target_config, len(draft_ids)) | {"torch_dtype": np.dtype(dtype).name}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    meta = {
        "kind": "eagle",
        "target": {
            "hidden_size": target_config.hidden_size,
            "vocab_size": target_config.vocab_size,
            "num_hidden_layers": target_config.num_hidden_layers,
            "model_type": target_config.model_type,
        }
        | ({"tokenizer_sha256": vocabulary_digest(tokenizer)} if tokenizer is not None else {}),
        "draft_vocab": len(draft_ids),
    }
    (out / "eagle.json").write_text(json.dumps(meta, indent=2))
    (out / "training_card.json").write_text(json.dumps(card, indent=2))


def import_head(folder: str | Path, target_config):
    """The inverse of `export`: (torch head, feature mean, feature std, draft→target ids) from a head folder."""
    import torch
    from safetensors.numpy import load_file

    folder = Path(folder)
    eagle, model = load_file(str(folder / "eagle.safetensors")), load_file(str(folder / "model.safetensors"))
    head = EagleHeadModule(target_config, int(eagle["draft_to_target"].size))
    state = {name: eagle[name] for name in ("fc_embed.weight", "fc_embed.bias", "fc_feature.weight")}
    state |= {"norm.weight": model["model.norm.weight"], "lm_head.weight": model["model.embed_tokens.weight"]}
    prefix = "model.layers.0."
    state |= {"layer." + k[len(prefix) :]: v for k, v in model.items() if k.startswith(prefix)}
    missing, unexpected = head.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    if unexpected or any(not k.startswith("rotary") for k in missing):
        raise ValueError(f"{folder}: head tensors missing {missing} or unexpected {unexpected}")
    mean, std = torch.tensor(eagle["feature_mean"]), torch.tensor(eagle["feature_std"])
    return head.eval(), mean, std, eagle["draft_to_target"].astype(np.int64)
