"""Compiling a speculative engine's verification pipelines in a background thread, so a first generation can
stream plain tokens while they compile.

Verifying k drafts runs the target over k + 1 rows, and row counts have pipelines of their own (the matmul's
row tiles 2, 4 and 8, the verifier); on a fresh 2-core lavapipe host SmolLM2's took 15-28 s (10 matmul
pipelines: about half their creation, half the LLVM code generation of their first dispatch; measured with
`tools/bench_compile.py`). The thread builds a shadow of the target (the same weights; its own activations, KV
cache and verifier) on a fork of the kernel registry, which shares compiled pipelines but keeps its own uniforms
and bind groups, and runs one verification step of each row count there. Nothing it records touches a buffer or
a uniform of the target, so the main thread keeps decoding meanwhile; wgpu-native releases the GIL while it
compiles.
The shadow's step times are not used: they were measured while the main thread ran too.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence

from doppler_py.model.transformer import Transformer

COMPILE_CONTEXT = 1  # positions before the compiled steps: a one-row prefill, whose pipelines exist


class PipelineWarmup:
    """Runs `make_engine(shadow target).calibrate([rows])` for each of `rows` (ascending) in a background thread.

    `compiled_rows`: every row count up to it is compiled, so a step verifying at most that many rows can run
    without compiling anything (an engine lets its first steps speculate with short drafts already).
    """

    def __init__(
        self,
        target: Transformer,
        make_engine: Callable[[Transformer], object],
        rows: Sequence[int],
        also: Callable[[], None] | None = None,
    ):
        """`also`: more compiling to do in the thread once the rows are done (a drafter's own pipelines)."""
        self.target = target
        self.rows = sorted(rows)
        self._also = also
        self.compiled_rows = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._cancel = threading.Event()
        self._make_engine = make_engine
        self._thread = threading.Thread(target=self._run, name="doppler-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        target = self.target
        registry = target.registry.fork()
        shadow = engine = None
        try:
            shadow = Transformer(
                target.weights,
                registry,
                max_rows=target.max_rows,
                max_logit_rows=target.max_logit_rows,
                max_positions=target.max_positions,
            )
            engine = self._make_engine(shadow)
            for rows in self.rows:
                if self._cancel.is_set():
                    break
                engine.calibrate([rows], context=COMPILE_CONTEXT, repeats=1, store=False)
                self.compiled_rows = rows
            if self._also is not None and not self._cancel.is_set():
                self._also()
        except BaseException as exc:  # reported to the main thread by `finish`
            self.error = exc
        finally:
            if engine is not None:
                engine.close()
            if shadow is not None:
                shadow.close()
            registry.close()
            self.done.set()

    def finish(self) -> None:
        """After `done`: join the thread. A failure is only a warning: whatever it could not compile compiles
        on first use in the main thread, which raises there if it really cannot."""
        self._thread.join()
        if self.error is not None:
            warnings.warn(
                f"compiling the speculative pipelines in the background failed ({self.error!r}); "
                "they compile on first use instead",
                RuntimeWarning,
                stacklevel=2,
            )

    def cancel(self) -> None:
        """Stop after the row count being compiled and wait for the thread (at most one compile, ~1 s)."""
        self._cancel.set()
        self._thread.join()
