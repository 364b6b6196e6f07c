"""What every draft-head trainer shares: the data stages (self-distillation) and the training loop.

    work/prompts.jsonl   seed instructions (seed_prompts.txt) + questions the target writes itself (Magpie:
                         the chat template's user prefix, sampled until the end of the turn)
    work/answers.jsonl   the target's answers (greedy; every `sampled_every`th batch sampled at T = 0.7), appended a
                         batch at a time (a restart skips what is there)
    work/features.pt     the target's features and choices per sequence (reused; new sequences computed alone)
    work/feature_taps.pt with `feature_taps`: those layers' outputs per sequence (float16), beside features.pt
    work/KIND.pt         a head's checkpoint every `save_every` steps (a restart resumes from it); a head continued
                         from a head folder (`init_from`) keeps its checkpoint in work/KIND-from-FOLDER.pt

Nothing is downloaded: the prompts and answers come from the target itself. Every (1 / `holdout`)th sequence
is kept out of training, to report how the head does on text it never saw; prompts appended later never move
a sequence from one set to the other.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from doppler_py.errors import GenerationOptionError

SEED_PROMPTS = Path(__file__).with_name("seed_prompts.txt")


@dataclass(frozen=True)
class TrainOptions:
    magpie_prompts: int = 0  # questions the target writes itself, on top of the seed list
    use_prompts: int | None = None  # answer and train on the first N prompts only (None: all); the rest wait
    # in prompts.jsonl for a later run, so a long answers stage can be spread over sessions
    seed_prompts: int | None = None  # how many seed instructions to use (None: all)
    max_new_tokens: int = 128
    answer_batch: int = 32  # prompts answered (and questions written) together, left-padded: on 2 CPU cores
    # SmolLM2-135M makes 59 tokens/s at 8, 101 at 32, 130 at 64
    sampled_every: int = 4  # every Nth batch gets its answers by sampling at T = 0.7 (the rest greedily); 0: never
    draft_vocab: int = 8192
    steps: int = 1500
    lr: float = 1e-3
    sequences_per_step: int = 4
    unroll_weight: float = 0.8
    unroll_steps: int = 3  # EAGLE: draft steps per anchor in training-time test (1: teacher forcing only)
    soft_targets: bool = True  # EAGLE: cross-entropy against the target's distribution, not its argmax
    feature_weight: float = 1.0  # EAGLE: weight of the feature regression (0: none, as EAGLE-3)
    feature_taps: tuple[int, ...] = ()  # EAGLE-3 fusion: target layers whose outputs join the last layer's
    # feature in the head's first draft (0-based layer indices)
    save_every: int = 200
    head_dtype: str = "float16"  # the exported weights (feature statistics stay float32)
    seed: int = 0
    init_from: str | None = None  # EAGLE: a head folder to continue training (its draft vocabulary and feature
    # statistics are kept), e.g. a shipped head on data added since it was trained
    holdout: float = 0.05  # fraction of the sequences kept for validation (at least one when there are two)
    medusa_heads: int = 4  # Medusa: heads, head i proposing the token i + 1 places after the target's own
    spark_block: int = 4  # spark: tokens one block proposes
    spark_rank: int = 32  # spark: rank of the previous-token bias (a multiple of 32)


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
    seen = {r["prompt"] for r in have}  # the target repeats itself; a repeated question adds no data
    seeds = [line.strip() for line in SEED_PROMPTS.read_text().splitlines() if line.strip()]
    for text in seeds[: options.seed_prompts]:  # seeds added to the list since an earlier run go at the end
        if text not in seen:
            _append_jsonl(path, {"source": "seed", "prompt": text})
            seen.add(text)
    written = sum(1 for r in _read_jsonl(path) if r["source"] == "magpie")
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
            if len(text) >= 8 and text not in seen and written < options.magpie_prompts:
                _append_jsonl(path, {"source": "magpie", "prompt": text})
                seen.add(text)
                written += 1
        say(f"prompts: {written}/{options.magpie_prompts} written by the target ({time.perf_counter() - start:.0f} s)")
    return [r["prompt"] for r in _read_jsonl(path)]


def make_answers(
    hf, tokenizer, prompts: list[str], work: Path, options: TrainOptions, say
) -> tuple[list[list[int]], list[int]]:
    """Stage 2: prompt + answer token ids per prompt, and where each answer starts (resumable; a batch at a
    time, left-padded)."""
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
    records = _read_jsonl(path)[: len(prompts)]  # an earlier run may have answered more (`use_prompts`)
    return [r["prompt_ids"] + r["answer_ids"] for r in records], [len(r["prompt_ids"]) for r in records]


def target_features(
    hf,
    sequences: list[list[int]],
    batch_tokens: int = 4096,
    say: Callable[[str], None] | None = None,
    taps: tuple[int, ...] = (),
):
    """Per sequence: (features [T, H] before the final norm, the target's argmax [T], the outputs of the layers
    `taps` [T, len(taps), H] in float16, or None without taps).

    Sequences of similar length go through the target together (right-padded, so a causal model's real positions
    never see the padding), `batch_tokens` tokens at most; `say` hears the progress every ~30 s."""
    import torch

    captured: dict = {}

    def keep(name):
        return lambda _m, _i, out: captured.update({name: out[0] if isinstance(out, tuple) else out})

    layers = hf.model.layers
    hooks = [layers[-1].register_forward_hook(keep("x"))]
    hooks += [layers[layer].register_forward_hook(keep(n)) for n, layer in enumerate(taps)]
    data: list = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    total, done, start, told = sum(map(len, sequences)), 0, time.perf_counter(), time.perf_counter()
    try:
        with torch.no_grad():
            while order:
                width = len(sequences[order[-1]])
                group = order[-max(1, batch_tokens // max(1, width)) :]  # the longest left, within the budget
                del order[-len(group) :]
                ids = torch.zeros(len(group), width, dtype=torch.long)
                mask = torch.zeros(len(group), width, dtype=torch.long)
                for row, i in enumerate(group):
                    ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                    mask[row, : len(sequences[i])] = 1
                argmax = hf(ids, attention_mask=mask).logits.argmax(-1)
                for row, i in enumerate(group):
                    n = len(sequences[i])
                    tapped = torch.stack([captured[t][row, :n] for t in range(len(taps))], 1).half() if taps else None
                    data[i] = (captured["x"][row, :n].float().clone(), argmax[row, :n].clone(), tapped)
                    done += n
                if say is not None and time.perf_counter() - told > 30:
                    told = time.perf_counter()
                    say(f"features: {done}/{total} tokens ({told - start:.0f} s)")
    finally:
        for hook in hooks:
            hook.remove()
    return data


@dataclass
class Corpus:
    """The target's sequences with its features and choices, split for training and validation."""

    hf: object  # the torch target
    tokenizer: object
    prompts: int
    sequences: list[list[int]]
    answer_starts: list[int]  # index in each sequence of the answer's first token
    data: list  # per sequence: (features [T, H] before the final norm, the target's argmax [T], the outputs of
    # the layers `feature_taps` [T, taps, H] or None)
    train: list[int]  # indices of the training sequences
    valid: list[int]  # indices of the held-out ones
    draft_ids: list[int]  # the draft vocabulary: the most frequent target choices, most frequent first
    to_draft: object  # long [target vocab]: draft id of each target id, -100 outside the draft vocabulary
    coverage: float  # share of the target's choices inside the draft vocabulary
    times: dict[str, float]

    def with_draft_vocabulary(self, draft_ids: list[int]) -> Corpus:
        """This corpus with the draft vocabulary `draft_ids` (a continued head keeps its own)."""
        import torch

        to_draft = torch.full((self.hf.config.vocab_size,), -100, dtype=torch.long)
        to_draft[torch.tensor(draft_ids, dtype=torch.long)] = torch.arange(len(draft_ids))
        choices = torch.cat([self.data[i][1] for i in self.train]) if self.train else torch.zeros(0, dtype=torch.long)
        coverage = float((to_draft[choices] >= 0).double().mean()) if len(choices) else 0.0
        return replace(self, draft_ids=[int(t) for t in draft_ids], to_draft=to_draft, coverage=coverage)

    @property
    def tokens(self) -> int:
        return int(sum(len(s) for s in self.sequences))

    def draft_rows(self):
        """The target's output rows of the draft vocabulary [N, H]: where a head's LM head starts."""
        import torch

        return self.hf.get_output_embeddings().weight.detach()[torch.tensor(self.draft_ids)]

    def normed(self, i: int):
        """h = final_norm(f) of sequence i [T, H], what Medusa and spark heads read (no gradient)."""
        import torch

        with torch.no_grad():
            return self.hf.model.norm(self.data[i][0])

    def answer_positions(self, i: int, length: int):
        """Of positions p = 0..length-1 of sequence i, those where the next token is part of the answer (bool):
        the positions drafting happens at."""
        import torch

        return torch.arange(length) >= self.answer_starts[i] - 1


def _sequence_key(sequence: list[int], model: str) -> str:
    return hashlib.sha256(json.dumps([model, sequence]).encode()).hexdigest()


def _taps_path(path: Path) -> Path:
    return path.with_name("feature_taps.pt")


def cached_features(sequences: list[list[int]], path: Path, model: str, taps: tuple[int, ...] = ()) -> list:
    """Stage 3's results from earlier runs on the same model, per sequence: (features, argmax, the outputs of the
    layers `taps` or None without taps), None where a sequence has none yet (prompts added since are computed
    alone) or lacks the taps asked for."""
    import torch

    found: list = [None] * len(sequences)
    if not path.is_file():
        return found
    cached = torch.load(path)
    tapped: dict = {}
    if taps:
        stored = torch.load(_taps_path(path)) if _taps_path(path).is_file() else {}
        if tuple(stored.get("layers", ())) == tuple(taps):
            tapped = dict(zip(stored["keys"], stored["taps"], strict=True))
    index = {key: j for j, key in enumerate(cached.get("keys", []))}
    for i, sequence in enumerate(sequences):
        key = _sequence_key(sequence, model)
        j = index.get(key)
        if j is not None and (not taps or key in tapped):
            found[i] = (cached["features"][j], cached["argmax"][j], tapped.get(key))
    return found


def save_features(data: list, sequences: list[list[int]], path: Path, model: str, taps: tuple[int, ...] = ()) -> None:
    """Write `data` (see `cached_features`) to `path`, and the taps' outputs beside it."""
    import torch

    keys = [_sequence_key(s, model) for s in sequences]
    torch.save({"keys": keys, "features": [d[0] for d in data], "argmax": [d[1] for d in data]}, path)
    if taps:
        torch.save({"layers": list(taps), "keys": keys, "taps": [d[2] for d in data]}, _taps_path(path))


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else -1


def prepare(model: str | Path, work: Path, options: TrainOptions, say: Callable[[str], None]) -> Corpus:
    """Stages 1–3: prompts, answers, the target's features; then the draft vocabulary and the split."""
    import torch

    work.mkdir(parents=True, exist_ok=True)
    # Wall time per stage, summed over every run that worked on this folder (stages resume across runs).
    times_file = work / "stage_times.json"
    times: dict[str, float] = json.loads(times_file.read_text()) if times_file.is_file() else {}

    def timed(stage: str, t0: float, made: Path | None = None, size_before: int = 0) -> None:
        """Adds a stage's time, unless it only reused `made` (the file it appends to, unchanged): a reuse must
        not move the recorded wall time of the work folder (kept in the repository for the shipped heads)."""
        if made is not None and _size(made) == size_before:
            return
        times[stage] = times.get(stage, 0.0) + time.perf_counter() - t0
        times_file.write_text(json.dumps(times, indent=2))

    hf, tokenizer = load_target(model)
    layers = hf.config.num_hidden_layers
    if any(not 0 <= t < layers for t in options.feature_taps):
        raise GenerationOptionError(f"feature taps {list(options.feature_taps)}: {model} has layers 0..{layers - 1}")
    torch.manual_seed(options.seed)
    t0, before = time.perf_counter(), _size(work / "prompts.jsonl")
    prompts = make_prompts(hf, tokenizer, work, options, say)[: options.use_prompts]
    timed("prompts_s", t0, work / "prompts.jsonl", before)
    t0, before = time.perf_counter(), _size(work / "answers.jsonl")
    sequences, starts = make_answers(hf, tokenizer, prompts, work, options, say)
    timed("answers_s", t0, work / "answers.jsonl", before)
    t0 = time.perf_counter()
    taps = tuple(options.feature_taps)
    data = cached_features(sequences, work / "features.pt", str(model), taps)
    missing = [i for i, d in enumerate(data) if d is None]
    if not missing:
        say("features: reused from features.pt")
    else:
        if len(missing) < len(sequences):
            say(f"features: {len(sequences) - len(missing)} sequences reused from features.pt")
        computed = target_features(hf, [sequences[i] for i in missing], say=say, taps=taps)
        for i, d in zip(missing, computed, strict=True):
            data[i] = d
        save_features(data, sequences, work / "features.pt", str(model), taps)
        timed("features_s", t0)
        tokens, seconds = sum(len(sequences[i]) for i in missing), time.perf_counter() - t0
        say(f"features: {len(missing)} sequences, {tokens} tokens ({seconds:.0f} s)")
    train, valid = split(len(sequences), options.holdout)
    counts = Counter(int(t) for i in train for t in data[i][1].tolist())
    draft_ids = [t for t, _ in counts.most_common(min(options.draft_vocab, hf.config.vocab_size))]
    corpus = Corpus(hf, tokenizer, len(prompts), sequences, starts, data, train, valid, [], None, 0.0, times)
    return corpus.with_draft_vocabulary(draft_ids)


def split(n: int, holdout: float) -> tuple[list[int], list[int]]:
    """(training, validation) indices of n sequences: every round(1 / holdout)th held out, at least one when
    there are two."""
    period = max(2, round(1 / holdout)) if holdout > 0 else n + 1
    valid = [i for i in range(n) if i % period == period - 1] or ([n - 1] if n > 1 else [])
    held = set(valid)
    return [i for i in range(n) if i not in held], valid


def train_loop(
    head, sequence_loss: Callable[[int], object], corpus: Corpus, checkpoint: Path, options: TrainOptions, say
) -> tuple[int, list[float]]:
    """AdamW with a cosine schedule over `options.steps`, `sequences_per_step` training sequences a step;
    resumes from `checkpoint` (when made for the same draft vocabulary). Returns (steps, losses); the seconds of
    training over all runs that built the checkpoint go to the corpus's stage times as train_s."""
    import torch

    opt = torch.optim.AdamW(head.parameters(), lr=options.lr)
    step, losses, earlier_s = 0, [], 0.0
    if checkpoint.is_file():
        state = torch.load(checkpoint)
        if state["draft_ids"] == corpus.draft_ids:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            step, losses, earlier_s = state["step"], state["losses"], state.get("seconds", 0.0)
            say(f"train: resumed at step {step}")
    gen = torch.Generator().manual_seed(options.seed + step)
    t0 = time.perf_counter()
    while step < options.steps:
        for group in opt.param_groups:
            group["lr"] = options.lr * 0.5 * (1 + math.cos(math.pi * step / options.steps))
        picks = torch.randint(len(corpus.train), (options.sequences_per_step,), generator=gen).tolist()
        total = sum(sequence_loss(corpus.train[i]) for i in picks) / len(picks)
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(float(total.detach()))
        if step % 50 == 0 or step == options.steps:
            mean_loss, seconds = np.mean(losses[-50:]), time.perf_counter() - t0
            say(f"train: step {step}/{options.steps} loss {mean_loss:.3f} ({seconds:.0f} s)")
        if step % options.save_every == 0 or step == options.steps:
            seconds = earlier_s + time.perf_counter() - t0
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "losses": losses,
                        "draft_ids": corpus.draft_ids, "seconds": seconds}, checkpoint)  # fmt: skip
    corpus.times["train_s"] = earlier_s + time.perf_counter() - t0
    return step, losses


def card(kind: str, model, options: TrainOptions, corpus: Corpus, steps: int, losses: list[float], **extra) -> dict:
    """The training card written beside a head."""
    from dataclasses import asdict

    return (
        {
            "kind": kind,
            "target": str(model),
            "options": asdict(options),
            "prompts": corpus.prompts,
            "sequences": len(corpus.sequences),
            "validation_sequences": len(corpus.valid),
            "tokens": corpus.tokens,
            "draft_vocab": len(corpus.draft_ids),
            "draft_vocab_coverage": round(corpus.coverage, 4),
            "steps": steps,
            "final_loss": float(np.mean(losses[-50:])) if losses else None,
        }
        | extra
        | {"wall_time_s": {k: round(v, 1) for k, v in corpus.times.items()}}
    )
