"""Verification of a speculative step on the GPU: accept/reject, residual draw, bonus token (`shaders/sample.wgsl`).

One step with k draft tokens reads the target's logits for the k+1 positions, the draft's logits (or none,
for a deterministic drafter), the tokens and the host-drawn uniforms, and writes ONE small result vector, so
the host learns everything from one readback:

    result[0] = n, the number of accepted drafts      result[1] = the token emitted after them
    result[2] = status (STATUS_* bits; 0 = healthy)   result[3 + i] = d_i for i < k (a copy of the drafts)

The contract (exact speculative sampling, filtered as the sampler filters) is the docstring of
`doppler_py.testing.verify_reference`, whose `verify_reference` is the numpy reference.
"""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.sampling import MAX_VOCAB
from doppler_py.sampling import SamplingParams

MAX_DRAFT_TOKENS = 16
# Status bits (the same constants are in the shader).
STATUS_TARGET_NONFINITE = 1  # NaN or +inf in a target row 0..k
STATUS_DRAFT_NONFINITE = 2  # NaN or +inf in a draft row the kernel read (draft mode, temperature > 0)
STATUS_DRAFT_TOKEN_OUT_OF_RANGE = 4  # a draft token >= vocab (never accepted)

ROW_RESULT_WORDS = 3  # accepted, token, status per row (the shader's ROW_RESULT_WORDS)
_ROW_STATE_WORDS = 8  # the shader's RowState struct


def result_size(max_k: int) -> int:
    """Elements of the u32 `result` tensor a SpecVerify with this max_k writes."""
    return max_k + 3


class SpecVerify:
    """Verifies up to `max_k` draft tokens against `vocab`-wide logits into `result` (see the module docstring).

    target_logits: f32 [>= (max_k + 1) * vocab], row i scores draft token i and row k gives the bonus token;
    draft_logits: f32 [>= max_k * vocab], the draft's rows the drafts were sampled from, or None for an op
    that only runs in one-hot mode; tokens: u32 [>= max_k + 1], tokens[0] the last committed token (unread)
    and tokens[1 + i] = d_i; randoms: f32 [>= 2 * max_k + 1], randoms[k + i] tests d_i and randoms[2k] is the
    final draw; result: u32 [>= max_k + 3].
    """

    def __init__(
        self,
        registry: KernelRegistry,
        target_logits: Tensor,
        draft_logits: Tensor | None,
        tokens: Tensor,
        randoms: Tensor,
        result: Tensor,
        *,
        vocab: int,
        max_k: int,
    ):
        if not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"vocab must be in [1, {MAX_VOCAB}], got {vocab}")
        if not 1 <= max_k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_k must be in [1, {MAX_DRAFT_TOKENS}], got {max_k}")
        for name, tensor, dtype, needed in (
            ("target_logits", target_logits, "f32", (max_k + 1) * vocab),
            ("draft_logits", draft_logits, "f32", max_k * vocab),
            ("tokens", tokens, "u32", max_k + 1),
            ("randoms", randoms, "f32", 2 * max_k + 1),
            ("result", result, "u32", result_size(max_k)),
        ):
            if tensor is not None and (tensor.dtype != dtype or tensor.numel < needed):
                raise ValueError(
                    f"SpecVerify {name}: need a {dtype} tensor of >= {needed} elements, "
                    f"got {tensor.dtype} {tensor.shape}"
                )
        gpu = registry.gpu
        self.vocab = vocab
        self.max_k = max_k
        self.has_draft_logits = draft_logits is not None
        # Scratch: the draft rows' filtered distributions, and each row's (accepted, token, status).
        # f32 keeps the Dawn replay's comparison of the states tolerant of rounding in their float fields.
        self.draft_states = Tensor.empty(gpu, (max_k, _ROW_STATE_WORDS), "f32", label="spec draft states")
        self.row_results = Tensor.empty(gpu, (max_k + 1, ROW_RESULT_WORDS), "u32", label="spec row results")
        slot = registry.uniform_slot(registry.kernel("sample", "spec_rows").uniform).set(vocab=vocab)
        # In one-hot mode the draft's logits are never read; the target's stand in for the binding.
        rows_draft_logits = draft_logits if draft_logits is not None else target_logits
        self.draft_filter = registry.bind(
            registry.kernel("sample", "spec_draft_filter"),
            slot,
            logits=rows_draft_logits,
            draft_states=self.draft_states,
        )
        self.rows = registry.bind(
            registry.kernel("sample", "spec_rows"),
            slot,
            logits=target_logits,
            randoms=randoms,
            draft_logits=rows_draft_logits,
            draft_states=self.draft_states,
            tokens=tokens,
            row_results=self.row_results,
        )
        self.finalize = registry.bind(
            registry.kernel("sample", "spec_finalize"), slot, tokens=tokens, row_results=self.row_results, result=result
        )
        self.params = slot

    def record_plain(self, rec: Recorder, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        """Record a plain step's token choice: target row 0 sampled with u = randoms[0], as `Sampler` does,
        plus the status word. It is a step with k = 0 (no drafts: row 0 is the bonus row), so a plain step
        reports NaN/inf logits like a speculative one; result = [0, token, status]."""
        options = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        self.params.set(
            temperature=options.temperature,
            top_k=options.top_k if options.top_k < self.vocab else 0,
            top_p=options.top_p,
            k=0,
            onehot=1,
        )
        rec.dispatch(self.rows, 1)
        rec.dispatch(self.finalize, 1)

    def release(self, registry: KernelRegistry) -> None:
        """Free the op's scratch buffers and uniform slot (the bound inputs and result belong to the caller)."""
        registry.release_tensors(self.draft_states, self.row_results)
        registry.release_slot(self.params)

    def record(
        self, rec: Recorder, k: int, temperature: float, top_k: int = 0, top_p: float = 1.0, onehot: bool = False
    ) -> None:
        """Record the verification of k drafts (greedy when temperature is 0; top_k 0 / top_p 1 = off)."""
        if not 1 <= k <= self.max_k:
            raise ValueError(f"SpecVerify.record: k must be in [1, {self.max_k}] (the op's max_k), got {k}")
        options = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        reads_draft = not onehot and not options.greedy
        if reads_draft and not self.has_draft_logits:
            raise ValueError("SpecVerify.record: this op has no draft_logits, so it runs only with onehot=True")
        self.params.set(
            temperature=options.temperature,
            top_k=options.top_k if options.top_k < self.vocab else 0,
            top_p=options.top_p,
            k=k,
            onehot=int(onehot),
        )
        if reads_draft:
            rec.dispatch(self.draft_filter, k)
        rec.dispatch(self.rows, k + 1)
        rec.dispatch(self.finalize, 1)
