"""Counters and timings of one speculative generation."""

from __future__ import annotations

from dataclasses import dataclass, field

from doppler_py.speculative.timing import StepTimes


@dataclass
class SpecStats:
    """What happened during one generation. Times are host wall-clock seconds unless named gpu_*.

    draft_s is the host time of drafting (for a GPU drafter: recording and submitting its work); verify_s runs
    from there to the step's readback, so it includes waiting for GPU drafting; plain_s is plain steps'. The
    gpu_* sums come from GPU timestamps (None where the adapter has none): drafting and verification as the GPU
    ran them.
    """

    drafter: str = ""
    steps: int = 0  # speculative steps (draft + one batched verification)
    tree_steps: int = 0  # of those, steps that verified a token tree (drafted counts its nodes)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    forced_tokens: int = 0  # drafts a grammar forced (drafted and accepted count them too)
    plain_steps: int = 0  # single-token steps taken while speculation was off or nothing was drafted
    warmup_steps: int = 0  # of those, tokens made while speculation was not ready (compiling, or not worth it yet)
    # The compile the warm-up would need, weighed before it starts (`readiness.compile_gate`): its estimated cost,
    # and what speculation could save over the tokens to come; None: not weighed.
    compile_cost_s: float | None = None
    compile_gain_s: float | None = None
    joined_at: int | None = None  # the answer's tokens before its drafter joined it mid-answer (None: from the start)
    drafted: int = 0
    made: int = 0  # drafts made, verified or not (a drafter's chain cut by the engine, `Proposal.made`)
    accepted: int = 0
    generated: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [i] = steps that drafted a token at position i
    accepted_at: list[int] = field(default_factory=list)  # [i] = steps whose draft token i was accepted
    draft_s: float = 0.0
    verify_s: float = 0.0
    plain_s: float = 0.0
    gpu_draft_s: float | None = None
    gpu_verify_s: float | None = None
    prefill_s: float = 0.0
    total_s: float = 0.0
    k_history: list[int] = field(default_factory=list)
    stopped_by: str = "max_tokens"  # "max_tokens" or "eos"

    def record(self, drafted: int, accepted: int, times: StepTimes, made: int | None = None) -> None:
        """One step: `drafted` proposals verified (0: a plain step), `accepted` of them kept, its times, and the
        drafts `made` for it (None: `drafted`; more where the engine cut the proposal, even to a plain step)."""
        made = drafted if made is None else max(made, drafted)
        self.made += made
        if times.gpu_verify_s is not None and made:
            self.gpu_draft_s = (self.gpu_draft_s or 0.0) + times.gpu_draft_s
            self.gpu_verify_s = (self.gpu_verify_s or 0.0) + times.gpu_verify_s
        if drafted == 0:
            self.plain_steps += 1
            self.plain_s += times.total_s
            return
        self.draft_s += times.draft_s
        self.verify_s += times.verify_s
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.k_history.append(drafted)
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a speculative step produced on average (accepted drafts + the verifier's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens per target forward over every step, plain ones included (`tokens_per_step` counts only the
        steps that verified drafts)."""
        forwards = self.steps + self.plain_steps
        return self.generated / forwards if forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    @property
    def decode_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "drafter": self.drafter,
            "steps": self.steps,
            "tree_steps": self.tree_steps,
            "cached_tokens": self.cached_tokens,
            "forced_tokens": self.forced_tokens,
            "plain_steps": self.plain_steps,
            "warmup_steps": self.warmup_steps,
            "compile_cost_s": None if self.compile_cost_s is None else round(self.compile_cost_s, 2),
            "compile_gain_s": None if self.compile_gain_s is None else round(self.compile_gain_s, 2),
            "joined_at": self.joined_at,
            "drafted": self.drafted,
            "made": self.made,
            "accepted": self.accepted,
            "generated": self.generated,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_per_step": round(self.mean_accepted_per_step, 3),
            "tokens_per_step": round(self.tokens_per_step, 3),
            "tokens_per_forward": round(self.tokens_per_forward, 3),
            "acceptance_by_position": [round(x, 3) for x in self.acceptance_by_position],
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "plain_s": round(self.plain_s, 4),
            "gpu_draft_s": None if self.gpu_draft_s is None else round(self.gpu_draft_s, 4),
            "gpu_verify_s": None if self.gpu_verify_s is None else round(self.gpu_verify_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "total_s": round(self.total_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "stopped_by": self.stopped_by,
        }
