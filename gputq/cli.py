"""The ``gputq`` console script: ``demo`` and ``info``."""

from __future__ import annotations

import argparse
import json
import sys

from .config import EXPERT_DTYPES, TRANSPORTS

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gputq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the whole offload path on an embedded local Ray")
    demo.add_argument("--sessions", type=int, default=8, help="synthetic rollout sessions")
    demo.add_argument("--steps", type=int, default=4, help="model calls per session")
    demo.add_argument("--units", type=int, default=2, help="StorageUnits")
    demo.add_argument("--ranks", type=int, default=2, help="trainer data-parallel ranks")
    demo.add_argument("--dtype", choices=EXPERT_DTYPES, default="uint16", help="stored expert-ID dtype")
    demo.add_argument("--layers", type=int, default=48, help="recorded MoE layers L")
    demo.add_argument("--topk", type=int, default=8, help="routing top-k K")
    demo.add_argument("--experts", type=int, default=128, help="experts per layer")
    demo.add_argument("--tokens", type=int, default=1024, help="output tokens per model call")
    demo.add_argument("--transport", choices=TRANSPORTS, default="auto")
    demo.add_argument("--device", default="cpu", help="trainer restore device: cpu or cuda")
    demo.add_argument("--view", choices=("timeline", "lineage"), default="lineage")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="last line of output: one JSON object")

    info = sub.add_parser("info", help="versions, transports, devices and what auto would choose")
    info.add_argument("--json", action="store_true")

    from .capacity import build_parser as capacity_parser

    capacity_parser(sub.add_parser("capacity", help="R3 bytes of a rollout and the master node's projected peak"))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import DemoOptions, run_demo

        options = DemoOptions(**{k: v for k, v in vars(args).items() if k not in ("command", "json")})
        result = run_demo(options, progress=not args.json)
        if args.json:
            print(json.dumps(result))
        return 0 if result["verified"] else 1
    if args.command == "capacity":
        from .capacity import run

        return run(args)
    if args.command == "info":
        from .info import collect_info, format_info

        data = collect_info()
        print(json.dumps(data, default=str) if args.json else format_info(data))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
