"""The drafters by the name `speculative=` and `--speculative` give them: the one table the API, the CLI, the
server, the router and the benchmarks read. Adding a drafter is its own file and one line in `DRAFTERS`.

Besides these, `speculative="auto"` picks per model (a loaded draft model, else the first trained head in
`HEAD_KINDS` order paired with prompt lookup, else prompt lookup) and `"none"` decodes plainly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from doppler_py.model.transformer import Transformer
    from doppler_py.speculative.contract import Drafter
    from doppler_py.tokenizer import Tokenizer


def _new(path: str, *args: Any) -> Any:
    """Call "module:name" (a drafter class, a head loader) with `args`, importing it only then: the table is read
    by every CLI start and must stay cheap to import."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)(*args)


@dataclass(frozen=True)
class DraftSources:
    """What a drafter is made from: the target, the draft model loaded beside it (or None), the trained heads
    loaded for it by kind."""

    target: Transformer
    draft: Transformer | None
    heads: Mapping[str, object]


@dataclass(frozen=True)
class HeadKind:
    """A kind of trained draft head: its files are `KIND.json` and `KIND.safetensors` in one folder."""

    article: str  # "an EAGLE": how messages name one
    loader: str  # "module:function" loading one onto a target: (folder, target, weights, tokenizer) -> head
    trainer: str  # the module whose `train()` makes one (torch; imported only by `train-draft`)

    def load(self, folder: Path, target: Transformer, weights: str | None, tokenizer: Tokenizer | None) -> object:
        return _new(self.loader, folder, target, weights, tokenizer)


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    make: Callable[[DraftSources], Drafter]
    summary: str
    needs_draft_model: bool = False
    head: HeadKind | None = None  # the trained head it drafts with (made by `train-draft --kind NAME`)
    trees: bool = False  # its steps can verify token trees
    exact_when_sampling: bool = True  # sampled output keeps the target's distribution


def _head_drafter(name: str, drafter: str, loader: str, article: str, summary: str, trees: bool = True) -> DrafterSpec:
    """A drafter with a trained head of its own kind: its code in speculative/drafters/heads/NAME.py (the drafter
    class and the head loader), its trainer in training/NAME.py, its head loaded as `heads[NAME]`."""
    module = f"doppler_py.speculative.drafters.heads.{name}"
    return DrafterSpec(
        name,
        lambda s: _new(f"{module}:{drafter}", s.target, s.heads[name]),
        summary,
        head=HeadKind(article, f"{module}:{loader}", f"doppler_py.training.{name}"),
        trees=trees,
    )


DRAFTERS: dict[str, DrafterSpec] = {
    spec.name: spec
    for spec in (
        DrafterSpec(
            "prompt-lookup",
            lambda s: _new("doppler_py.speculative.drafters.prompt_lookup:PromptLookupDrafter"),
            "n-gram matches in the prompt and answer so far",
            trees=True,
        ),
        DrafterSpec(
            "draft-model",
            lambda s: _new(
                "doppler_py.speculative.drafters.draft_model:DraftModelDrafter", s.draft, s.target.config.vocab_size
            ),
            "a smaller model with the same vocabulary (load(..., draft=PATH), --draft PATH)",
            needs_draft_model=True,
            trees=True,
        ),
        DrafterSpec(
            "layer-skip",
            lambda s: _new("doppler_py.speculative.drafters.layer_skip:LayerSkipDrafter", s.target),
            "the target's first half of layers drafts",
        ),
        DrafterSpec(
            "lookahead",
            lambda s: _new("doppler_py.speculative.drafters.lookahead:LookaheadDrafter", s.target),
            "a Jacobi window and its n-gram pool, no training; every step one tree",
            trees=True,
        ),
        _head_drafter(
            "eagle", "EagleDrafter", "load_head", "an EAGLE", "a trained EAGLE head on the target's features"
        ),
        _head_drafter(
            "medusa", "MedusaDrafter", "load_medusa", "a Medusa", "trained Medusa heads, one per position ahead"
        ),
        _head_drafter(
            "spark",
            "SparkDrafter",
            "load_spark",
            "a spark",
            "a trained block drafter with a confidence cut",
            trees=False,
        ),
    )
}
HEAD_KINDS = tuple(name for name, spec in DRAFTERS.items() if spec.head is not None)  # "auto" prefers this order


def speculative_modes() -> tuple[str, ...]:
    """What `speculative=` takes besides None / "none", read when asked (a drafter registered later counts)."""
    return ("auto", *DRAFTERS)
