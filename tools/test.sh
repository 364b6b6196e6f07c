#!/usr/bin/env bash
# README command 2: install what is missing (including the test-only tools), then run the test suite.
#   bash tools/test.sh            everything: lint, then the whole suite; every distinct pipeline the kernel tests
#                                 dispatch is also replayed under Dawn/Tint (Chrome's WebGPU) and must match wgpu-py;
#                                 then the kernels and the drafters' exactness again, in process on Dawn
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
DOPPLER_DAWN_REPLAY=1 .venv/bin/python -m pytest --durations=30
# Again on Dawn, the WebGPU implementation Chrome ships (Tint compiling our WGSL; tests/model/test_smollm2_dawn.py
# ran above): the kernels whose pipelines Mesa 25's lavapipe, Dawn's driver on a CPU-only machine, compiles in
# seconds (matmul and attention take it minutes for all their variants), and on the tiny models the greedy exactness
# of prompt lookup, a draft model, a token tree, trained Medusa heads and a trained spark block plus one sampled joint
# distribution. CI's Mesa shader cache starts empty, and these compile ~4 CPU minutes cold (every k and drafter,
# lookahead and the tree grid: ~10; an EAGLE head ~2 more; docs/testing.md has the commands for all of them).
SPEC=tests/speculative
HEADS=$SPEC/drafters/heads
.venv/bin/python -m pytest -q --webgpu dawn --durations=10 tests/gpu/test_webgpu_choice.py \
  tests/kernels/test_{rmsnorm,softmax,rope,residual,swiglu,embedding,sample,logprobs,token_mask}.py \
  tests/kernels/test_{penalties,logit_softcap,vocab_scatter,stream_read,tree_ops,spec_verify,standardize}.py \
  "$SPEC/test_engine.py::test_greedy_speculative_equals_plain_greedy[prompt-lookup-4]" \
  "$SPEC/test_engine.py::test_greedy_speculative_equals_plain_greedy[draft-model-4]" \
  "$SPEC/test_engine.py::test_two_token_joint_distribution_matches_the_target" \
  "$SPEC/trees/test_tree_steps.py::test_greedy_tree_decoding_is_plain_greedy_decoding[5-llama-tied-gqa]" \
  "$HEADS/test_medusa.py::test_greedy_medusa_equals_plain_greedy_and_drafts_as_the_trainer_does[llama-1-2]" \
  "$HEADS/test_spark.py::test_greedy_spark_equals_plain_greedy_and_drafts_as_the_trainer_does[llama-1-2]"
