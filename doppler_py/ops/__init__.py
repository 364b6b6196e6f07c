"""Typed wrappers around the WGSL kernels.

Each op binds its tensors ONCE (at model build time) and records dispatches many times:

    op = RMSNorm(registry, x, weight, out, dim=576, eps=1e-5, max_rows=64)
    rec = registry.recorder()
    op.record(rec, rows=5)          # per-call values (rows, positions) go into the op's uniform slot
    rec.submit()

An op instance owns one uniform slot, holding one set of values per submit: recording it again in the same
submit is allowed only with the same values (the Recorder raises otherwise), so a forward pass builds one op
per layer and call site.
"""
