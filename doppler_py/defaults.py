"""A generation's defaults: one set for the Python API (`load`, `Engine.stream`/`generate`), the CLI and the
server, so the same request gives the same answer whichever way it comes in.

The headline is speculative decoding, so it is on by default: `auto` picks per model (a loaded draft model, else
the model's first trained head paired with prompt lookup, else prompt lookup); its pipelines compile in a
background thread while the first tokens stream plainly, so nothing waits for them. `None`/"none" decodes plainly.
"""

SPECULATIVE = "auto"  # the drafter (`registry.speculative_modes()`), or None / "none"
WARMUP = "auto"  # "auto", "background" or "now" (`api.load`)
K = None  # the draft tokens one step verifies; None: the policy chooses per step
TREE = None  # token trees: None where extra rows are nearly free (GPUs), True, False
MAX_TOKENS = 128
TEMPERATURE = 0.0  # greedy
TOP_K = 0  # all tokens
TOP_P = 1.0  # all the mass
MIN_P = 0.0  # off
REPEAT_LAST_N = 64  # the tokens the repetition penalty looks at (as llama.cpp); off while that penalty is 1
KV_CACHE_MB = 256  # GPU memory for earlier sequences' K/V, so shared prompt prefixes are not prefilled again
