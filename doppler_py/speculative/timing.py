"""Where a step's time goes, measured without adding GPU waits.

Host wall time is taken at three points of a step: start, end of drafting (`propose` returned, its GPU work
submitted but maybe not run), and end of the step's one readback, which waits for everything. On adapters with
the `timestamp-query` feature the GPU also stamps three moments: when all work before the step is done, when
the drafting is done (the start of the verification's command buffer), and when the verification is done. The
stamps are resolved inside the verification's command buffer and read after the result, when the GPU is
already idle, so nothing waits for them. Their values are taken as nanoseconds (what WebGPU specifies); a
stamp pair that is not monotonic or exceeds the host's wall time for the same span switches GPU timing off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from doppler_py.gpu.device import Gpu
from doppler_py.gpu.recorder import Recorder

_STAMPS = 3  # step start, drafting done, verification done


@dataclass
class StepTimes:
    draft_s: float  # host: the drafter's `propose` (recording and submitting its GPU work)
    verify_s: float  # host: from then to the end of the readback (includes waiting for the drafts' GPU work)
    gpu_draft_s: float | None  # GPU: from the end of earlier work to the end of drafting
    gpu_verify_s: float | None  # GPU: the verification's command buffer

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s


class StepClock:
    """Host and (where the adapter stamps time) GPU time of each step's phases."""

    def __init__(self, gpu: Gpu):
        self.gpu = gpu
        self.gpu_timing = "timestamp-query" in gpu.features
        self._query_set = self._resolved = None
        if self.gpu_timing:
            usage = gpu.api.BufferUsage
            self._query_set = gpu.device.create_query_set(type="timestamp", count=_STAMPS, label="step stamps")
            self._resolved = gpu.device.create_buffer(
                size=8 * _STAMPS, usage=usage.QUERY_RESOLVE | usage.COPY_SRC, label="stamps"
            )
        self._marks: list[float] = []
        self._stamping = False

    def start(self, recorder: Recorder, drafting: bool) -> None:
        """Before drafting. GPU stamps are taken only for steps that draft (a plain step has nothing to split,
        and its extra submit and readback measurably slowed plain decoding on lavapipe); `recorder` is then
        submitted at once, holding only the first stamp."""
        self._marks = [time.perf_counter()]
        self._stamping = self.gpu_timing and drafting
        if self._stamping:
            recorder.write_timestamp(self._query_set, 0)
            recorder.submit()

    def drafted(self) -> None:
        self._marks.append(time.perf_counter())

    def verify_begins(self, rec: Recorder) -> None:
        """Before the verification's first command (`step.StepMarks`)."""
        if self._stamping:
            rec.write_timestamp(self._query_set, 1)

    def verify_ends(self, rec: Recorder) -> None:
        """After the verification's last command."""
        if self._stamping:
            rec.write_timestamp(self._query_set, 2)
            rec.resolve_timestamps(self._query_set, _STAMPS, self._resolved)

    def stop(self) -> StepTimes:
        """After the step's readback."""
        start, drafted, end = *self._marks, time.perf_counter()
        times = StepTimes(drafted - start, end - drafted, None, None)
        if self._stamping:
            stamps = np.frombuffer(self.gpu.queue.read_buffer(self._resolved, 0, 8 * _STAMPS), np.uint64)
            t0, t1, t2 = (int(s) for s in stamps)
            if not t0 <= t1 <= t2 or (t2 - t0) * 1e-9 > (end - start) * 1.05 + 1e-3:
                self.gpu_timing = False  # the adapter's stamps are not nanoseconds of this queue: stop using them
            else:
                times.gpu_draft_s, times.gpu_verify_s = (t1 - t0) * 1e-9, (t2 - t1) * 1e-9
        return times

    def close(self) -> None:
        if self._query_set is not None:
            self._query_set.destroy()
            self._resolved.destroy()
            self._query_set = self._resolved = None
            self.gpu_timing = False
