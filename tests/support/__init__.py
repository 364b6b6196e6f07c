"""Code only the tests use: the host-side reference decoder, the distribution criterion every sampler test shares,
float margins of GPU sums, and the tree-path reference. (What the package itself, `doppler-py selfcheck` or the
benchmarks also use stays in `doppler_py.testing`.)"""
