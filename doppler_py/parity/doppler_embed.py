"""The JS original's embeddings on a sentence-transformers folder: its converter writes RDRR with the folder's
embedding head (pooling, Dense layers, Normalize), and its `embed` runs under Node.

`embedding_conversion_config` is the lane's float32 conversion config (`doppler_model.conversion_config`) made an
embedding model's, as the package's own EmbeddingGemma and Qwen3-Embedding configs are
(src/config/conversion/embeddinggemma/google-embeddinggemma-300m-q4k-ehf16-af32.json,
qwen3/qwen-3-embedding-0-6b-q4k-ehf16-af32.json): modelType "embedding"; attention causal unless config.json
asks for bidirectional attention, and then no window (the EmbeddingGemma config's slidingWindow is null, line 18);
and the head as `output.embeddingPostprocessor`. The converter needs the head in the config: it refuses a config
without that field (src/converter/conversion-plan.js:115; required-inference-fields-contract-check.js:136) and
then takes the config's over the one it parsed from modules.json (src/converter/core.js:2293-2299). So the lane
writes it from the folder's files (`EmbeddingHead.from_folder`); the converter still parses modules.json itself
(src/converter/parsers/transformer.js:73-192), refusing what it cannot run and renaming the Dense tensors.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.embeddings import EmbeddingHead
from doppler_py.parity import doppler_model
from doppler_py.parity.doppler_model import DopplerParityError
from doppler_py.parity.npm import DOPPLER_GPU, fetch_package

DRIVER = Path(__file__).with_name("doppler_embed.mjs")
# Our pooling names -> the package's (its parser reads the mean and last-token modes only).
POOLING = {"mean": "mean", "lasttoken": "last"}


@dataclass(frozen=True)
class DopplerEmbeddings:
    """The JS original's vectors ([inputs, width] float32), the pooling it used for each input, its phases and the
    Vulkan driver it ran on."""

    vectors: np.ndarray
    modes: list[str]
    phases: list[tuple[str, float]]
    driver: str


def embedding_postprocessor(head: EmbeddingHead) -> dict:
    """The manifest's `output.embeddingPostprocessor` for a sentence-transformers head, laid out as the package's
    EmbeddingGemma and Qwen3-Embedding configs lay it out (its Dense tensors under the names its converter gives
    them, src/converter/parsers/transformer.js:117-120)."""
    if head.pooling not in POOLING:
        raise DopplerParityError(
            f"pooling {head.pooling!r}: doppler-gpu pools by {' or '.join(POOLING)} only (transformer.js:13-33)"
        )
    projections = []
    for i, layer in enumerate(head.dense):
        if layer.activation != "Identity":
            raise DopplerParityError(f"Dense layer {i} activation {layer.activation!r}: doppler-gpu runs Identity only")
        projections.append(
            {
                "weightTensor": f"embedding_postprocessor.projections.{i}.weight",
                "biasTensor": None if layer.bias is None else f"embedding_postprocessor.projections.{i}.bias",
                "inputSize": layer.weight.shape[1],
                "outputSize": layer.weight.shape[0],
                "activation": "identity",
            }
        )
    return {
        "poolingMode": POOLING[head.pooling],
        "includePrompt": head.include_prompt,
        "projections": projections,
        "normalize": "l2" if head.normalize else None,
    }


def embedding_conversion_config(hf: dict, head: EmbeddingHead, package: Path, model_id: str) -> dict:
    """The float32 conversion config of an embedding model whose HF config is `hf` and whose sentence-transformers
    head is `head` (module docstring)."""
    config = doppler_model.conversion_config(hf, package, model_id)
    config["modelType"] = "embedding"
    inference = config["inference"]
    inference["output"]["embeddingPostprocessor"] = embedding_postprocessor(head)
    if hf.get("use_bidirectional_attention"):
        inference["attention"]["slidingWindow"] = None
    return config


def convert_embedding_model(
    folder: Path,
    out_dir: Path,
    package: Path | None = None,
    *,
    timeout: float = doppler_model.CONVERT_TIMEOUT_S,
) -> Path:
    """The folder (an HF model with its sentence-transformers files) in RDRR, by doppler-gpu's converter."""
    package = package or fetch_package(DOPPLER_GPU)
    hf = json.loads((folder / "config.json").read_text())
    head = EmbeddingHead.from_folder(folder, hf["hidden_size"])
    if not head.declared:
        raise DopplerParityError(f"{folder} has no modules.json: not a sentence-transformers embedding model")
    config = embedding_conversion_config(hf, head, package, model_id=folder.name.lower())
    return doppler_model.convert(folder, out_dir, package, timeout=timeout, config=config)


def embed(
    rdrr_dir: Path,
    inputs: Sequence[Sequence[int]],
    package: Path | None = None,
    *,
    timeout: float = doppler_model.RUN_TIMEOUT_S,
    log: Callable[[str], None] | None = None,
) -> DopplerEmbeddings:
    """The JS original's embedding of each input (token ids), all within `timeout` seconds."""
    if not inputs or any(not ids for ids in inputs):
        raise DopplerParityError("every input to embed needs at least one token id")
    job = {"inputs": [[int(t) for t in ids] for ids in inputs]}
    done = doppler_model.run_driver(
        DRIVER, rdrr_dir, job, package, timeout=timeout, what="doppler-gpu's embed", log=log
    )
    return DopplerEmbeddings(
        vectors=doppler_model.float32_rows(done.result["vectors"]),
        modes=list(done.result["modes"]),
        phases=done.phases,
        driver=done.driver,
    )


def embed_folder(
    folder: Path,
    inputs: Sequence[Sequence[int]],
    package: Path | None = None,
    *,
    timeout: float | None = None,
) -> DopplerEmbeddings:
    """Convert the folder and embed the inputs in the JS original; `timeout` limits each of the two."""
    package = package or fetch_package(DOPPLER_GPU)
    with tempfile.TemporaryDirectory(prefix="doppler-rdrr-") as rdrr:
        convert_limit = doppler_model.CONVERT_TIMEOUT_S if timeout is None else timeout
        converted = convert_embedding_model(folder, Path(rdrr), package, timeout=convert_limit)
        return embed(converted, inputs, package, timeout=doppler_model.RUN_TIMEOUT_S if timeout is None else timeout)
