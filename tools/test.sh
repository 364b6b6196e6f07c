#!/usr/bin/env bash
# README command 2: install what is missing (including the test-only tools), then run the test suite.
#   bash tools/test.sh            everything: lint, then the whole suite; then the kernels and the drafters'
#                                 exactness again, in process on Dawn (Chrome's WebGPU, Tint compiling our WGSL)
#   bash tools/test.sh --quick    the edit-test loop (a few minutes): lint, then the tests not marked slow, parity,
#                                 browser or realmodel
#   bash tools/test.sh ARGS...    only `pytest ARGS...` (e.g. tests/kernels -k matmul)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/bootstrap.sh" test
cd "$root"
lint() {
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
}
if [ "${1:-}" = --quick ]; then
  shift
  lint
  exec .venv/bin/python -m pytest -q -m "not slow and not parity and not browser and not realmodel" "$@"
fi
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
lint
# --durations: the slowest tests, for whoever next trims CI time.
.venv/bin/python -m pytest --durations=30
# Again on Dawn, the WebGPU implementation Chrome ships (Tint compiling our WGSL; tests/model/test_smollm2_dawn.py
# ran above), on two of its drivers (docs/testing.md has the figures and the commands for the rest):
# 1. Mesa 25's lavapipe, what `--webgpu dawn` takes on a machine without a GPU: the implementation switch, and the
#    kernels its LLVM compiles in seconds (~1 minute with CI's empty Mesa shader cache; matmul, attention and the
#    tiny models' forwards take it minutes each), with their statistical tests.
SPEC=tests/speculative
HEADS=$SPEC/drafters/heads
.venv/bin/python -m pytest -q --webgpu dawn --durations=5 tests/gpu/test_webgpu_choice.py \
  tests/kernels/test_{rmsnorm,softmax,rope,residual,swiglu,embedding,sample,logprobs,token_mask}.py \
  tests/kernels/test_{penalties,logit_softcap,vocab_scatter,stream_read,tree_ops,spec_verify,standardize}.py
# 2. SwiftShader, Chrome's own software driver (Debian's chromium ships it), which compiles a pipeline in
#    milliseconds and keeps no cache, so nothing here waits on a warm one: every kernel and device test but the
#    statistical ones (run above; slow on SwiftShader); then on the tiny models every drafter's greedy exactness
#    at k = 1, 4 and 8, lookahead's and the token trees' over every family, the trained EAGLE, Medusa and spark
#    heads', one sampled joint distribution, and the batch: `auto` drafting inside it, generations with different
#    drafters sharing one forward, a grammar with penalties over a token tree. (All of tests/speculative and
#    tests/model pass there: docs/testing.md.) DOPPLER_ADAPTER fails the lane if Dawn took another driver.
SWIFTSHADER=/usr/lib/chromium/vk_swiftshader_icd.json
on_swiftshader() {
  VK_ICD_FILENAMES=$SWIFTSHADER VK_DRIVER_FILES=$SWIFTSHADER DOPPLER_ADAPTER=swiftshader \
    .venv/bin/python -m pytest -q --webgpu dawn --durations=5 "$@"
}
on_swiftshader tests/kernels tests/gpu -k "not (the_target_distribution or the_filtered_distribution)"
on_swiftshader "$SPEC/test_engine.py" "$SPEC/drafters/test_lookahead.py" "$SPEC/trees/test_tree_steps.py" \
  "$HEADS/test_eagle.py::test_greedy_eagle_equals_plain_greedy_and_drafts_as_the_trainer_does[llama-eagle-1-1-3]" \
  "$HEADS/test_medusa.py::test_greedy_medusa_equals_plain_greedy_and_drafts_as_the_trainer_does[llama-1-2]" \
  "$HEADS/test_spark.py::test_greedy_spark_equals_plain_greedy_and_drafts_as_the_trainer_does[llama-1-2]" \
  "$SPEC/test_batch.py::test_every_drafter_drafts_inside_the_batch_and_each_generation_equals_its_solo_run[auto]" \
  "$SPEC/test_batch.py::test_generations_with_different_drafters_share_one_forward[greedy]" \
  "$SPEC/test_constrained.py::test_greedy_constrained_output_with_penalties_equals_the_reference[prompt-lookup-tree]" \
  -k "greedy_speculative_equals_plain_greedy or two_token_joint or plain_greedy_decoding or as_the_trainer_does \
      or drafts_inside_the_batch or share_one_forward or with_penalties_equals_the_reference"
