"""Convert a GGUF file (or a known model's GGUF) into a Hugging Face style folder doppler-py loads.

python tools/convert_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf out/smollm2-f16 --weights f16
python tools/convert_gguf.py smollm2-135m-instruct out/smollm2-q --weights keep
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from doppler_py.errors import DopplerError
from doppler_py.model.catalog import KNOWN_MODELS, known_model_file
from doppler_py.model.gguf import WEIGHT_MODES, convert_gguf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help=f"a .gguf file or a known model name ({', '.join(KNOWN_MODELS)})")
    parser.add_argument("out_dir", type=Path, help="folder to create (must not exist)")
    parser.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default="f16",
        help="f32, f16, or keep (Q4_0/Q4_1/Q8_0 blocks stay as raw bytes)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        source = known_model_file(args.source) if args.source in KNOWN_MODELS else Path(args.source)
        started = time.perf_counter()
        out = convert_gguf(source, args.out_dir, args.weights, progress=not args.quiet)
    except (DopplerError, FileExistsError) as exc:
        print(f"convert_gguf: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: {size / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
