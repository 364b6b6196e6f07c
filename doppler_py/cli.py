"""The `doppler-py` command line: a thin layer over the Python API."""

from __future__ import annotations

import argparse
import json
import sys

from doppler_py.errors import DopplerError


def _cmd_info(args: argparse.Namespace) -> int:
    from doppler_py.gpu.device import default_gpu

    gpu = default_gpu(browser_limits=args.browser_limits)
    print(json.dumps(gpu.summary(), indent=2))
    return 0


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    from doppler_py.selfcheck import run_selfcheck

    return 0 if run_selfcheck(print) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="doppler-py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="adapter, backend, features and limits")
    info.add_argument("--browser-limits", action="store_true", help="show the WebGPU default-limits device")
    info.set_defaults(func=_cmd_info)
    check = sub.add_parser("selfcheck", help="run every kernel once against numpy")
    check.set_defaults(func=_cmd_selfcheck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DopplerError as exc:
        print(f"doppler-py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
