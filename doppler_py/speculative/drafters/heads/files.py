"""Reading a trained draft head's folder: what it was made for, and its tensors, with typed errors that name
the file. Shared by the EAGLE, Medusa and spark heads.

Every head folder holds KIND.json with {"kind", "target": {hidden_size, vocab_size, num_hidden_layers,
model_type, tokenizer_sha256}, ...} and KIND.safetensors, whose draft_to_target [N] lists the target ids of
the head's reduced vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from doppler_py.errors import ModelFormatError, VocabularyMismatchError
from doppler_py.model.loader import BLOCK_FORMATS
from doppler_py.model.safetensors_file import load_array, read_header
from doppler_py.model.transformer import Transformer
from doppler_py.speculative.registry import DRAFTERS
from doppler_py.tokenizer import Tokenizer

HEAD_NAMES = {name: spec.head.article for name, spec in DRAFTERS.items() if spec.head is not None}


def vocabulary_digest(tokenizer: Tokenizer) -> str:
    """A fingerprint of a tokenizer's id ↔ token string table (added tokens included)."""
    vocab = sorted(tokenizer.backend.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def made_for(target_config, tokenizer: Tokenizer | None) -> dict:
    """The `target` record a trainer writes into KIND.json."""
    t = target_config
    record = {
        "hidden_size": t.hidden_size,
        "vocab_size": t.vocab_size,
        "num_hidden_layers": t.num_hidden_layers,
        "model_type": t.model_type,
    }
    return record | ({"tokenizer_sha256": vocabulary_digest(tokenizer)} if tokenizer is not None else {})


def head_kind(folder: str | Path) -> str:
    """ "eagle", "medusa" or "spark", from the description file the folder holds."""
    folder = Path(folder)
    kinds = [kind for kind in HEAD_NAMES if (folder / f"{kind}.json").is_file()]
    if len(kinds) != 1:
        raise ModelFormatError(
            f"{folder}: not a draft head folder (it needs exactly one of {', '.join(k + '.json' for k in HEAD_NAMES)})"
        )
    return kinds[0]


def read_meta(folder: Path, kind: str, target: Transformer, tokenizer: Tokenizer | None) -> dict:
    """KIND.json, checked against the target (hidden size, vocabulary, tokenizer)."""
    meta_file = folder / f"{kind}.json"
    if not meta_file.is_file():
        raise ModelFormatError(f"{folder}: no {kind}.json, so this is not {HEAD_NAMES[kind]} head folder")
    try:
        meta = json.loads(meta_file.read_text())
        target_record = dict(meta["target"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"{meta_file}: not a valid {HEAD_NAMES[kind]} head description ({exc})") from exc
    cfg = target.config
    if target_record.get("hidden_size") != cfg.hidden_size:
        raise ModelFormatError(
            f"{meta_file}: the head was made for hidden size {target_record.get('hidden_size')}, the target's is "
            f"{cfg.hidden_size}"
        )
    if target_record.get("vocab_size") != cfg.vocab_size:
        raise VocabularyMismatchError(
            f"{meta_file}: the head was made for a vocabulary of {target_record.get('vocab_size')} tokens, the "
            f"target has {cfg.vocab_size}"
        )
    digest = target_record.get("tokenizer_sha256")
    if tokenizer is not None and digest is not None and digest != vocabulary_digest(tokenizer):
        raise VocabularyMismatchError(
            f"{meta_file}: the head was made for another tokenizer (its id ↔ token table differs from the target's)"
        )
    return meta


def read_tensors(path: Path, shapes: dict[str, tuple[int, ...]], vocab: int) -> dict[str, np.ndarray]:
    """The tensors of KIND.safetensors with the expected `shapes`, plus a valid draft_to_target."""
    if not path.is_file():
        raise ModelFormatError(f"{path}: missing (the head's own tensors and draft vocabulary)")
    try:
        infos, _ = read_header(path)
        tensors = {name: np.asarray(load_array(info)) for name, info in infos.items()}
    except ModelFormatError:
        raise
    except Exception as exc:  # a truncated or garbled file
        raise ModelFormatError(f"{path}: cannot be read as safetensors ({exc})") from exc
    for name, shape in shapes.items():
        if name not in tensors:
            raise ModelFormatError(f"{path}: tensor {name} is missing")
        if tensors[name].shape != shape:
            raise ModelFormatError(f"{path}: tensor {name} has shape {tensors[name].shape}, expected {shape}")
    index = tensors.get("draft_to_target")
    if index is None or index.ndim != 1 or index.size == 0:
        raise ModelFormatError(f"{path}: tensor draft_to_target (the draft vocabulary's target ids) is missing")
    if index.dtype.kind not in "iu" or index.min() < 0 or index.max() >= vocab or np.unique(index).size != index.size:
        raise VocabularyMismatchError(f"{path}: draft_to_target holds ids outside the target's {vocab} or repeats")
    return tensors


def require_shapes(path: Path, tensors: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse `tensors` (read from `path`) unless each of `shapes` is there with its shape: the tensors whose
    shapes depend on the draft vocabulary's size, known only once `read_tensors` has read draft_to_target."""
    for name, shape in shapes.items():
        if name not in tensors or tensors[name].shape != shape:
            raise ModelFormatError(
                f"{path}: tensor {name} must have shape {shape}, got {getattr(tensors.get(name), 'shape', None)}"
            )


def dense_format(target: Transformer, precision: str, stored: np.dtype, *, in_target_blocks: bool = False) -> str:
    """The format of a head's matrices. With `in_target_blocks` (the EAGLE head), a target whose layers are kept in
    a block format (q4_0, q4_1, q8_0, or "keep" of a file stored in blocks) gets the head in its layers' format,
    so the head's matmuls run pipelines the target compiled already: on a CPU adapter each pipeline of the head's
    own costs ~1 s to compile, and in f16 the EAGLE head added 16 of `auto`'s 26 (issue 65), while with k = 1 it
    accepted 0.569 of its drafts in q4_1 against 0.580 in f16 (six open-ended prompts). Medusa's and spark's
    residual blocks lost more in q4_1 (at k = 2: 0.227 against 0.243, 0.299 against 0.309), and are not what
    `auto` drafts with: those stay f16 beside a compact target. Otherwise f16 for f16, f32 for f32, and under
    "keep" as the head stores them."""
    layers = target.weights.layers[0].down.format
    if in_target_blocks and layers in BLOCK_FORMATS:
        return layers
    if precision == "keep":
        return "f16" if stored == np.float16 else "f32"
    return "f16" if precision in ("f16", *BLOCK_FORMATS) else "f32"
