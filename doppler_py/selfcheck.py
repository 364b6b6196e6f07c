"""A quick end-to-end check that the WebGPU device runs our kernels correctly (`doppler-py selfcheck`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from doppler_py.gpu.device import default_gpu
from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.tensor import Tensor


def run_selfcheck(say: Callable[[str], None]) -> bool:
    gpu = default_gpu()
    say(f"adapter: {gpu.name} via {gpu.backend}; features: {sorted(gpu.features)}")
    registry = KernelRegistry(gpu)
    rng = np.random.default_rng(0)
    ok = True
    n = 1000
    acc, delta = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    t_acc, t_delta = Tensor.from_numpy(gpu, acc), Tensor.from_numpy(gpu, delta)
    rec = registry.recorder()
    rec.dispatch(registry.bind(registry.kernel("residual"), {"n": n}, delta=t_delta, acc=t_acc), workgroups(n, 256))
    rec.submit()
    err = float(np.abs(t_acc.numpy() - (acc + delta)).max())
    ok &= err <= 1e-6
    say(f"residual: max abs error {err:.2e} {'ok' if err <= 1e-6 else 'FAIL'}")
    return ok
