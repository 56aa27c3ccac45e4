"""The ``gputq`` console script: ``demo``, ``info``, ``stats`` and ``capacity``.

Bad input never ends in a traceback: every invalid value is refused with one
line on stderr and exit status 2, before Ray starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from gputq.cluster.deploy import serving_transport
from gputq.cluster.names import import_ray
from gputq.config import EXPERT_DTYPES, TRANSPORTS, GputqConfig
from gputq.data.fields import ROUTED_EXPERTS_DTYPES, routed_experts_spec, row_nbytes
from gputq.errors import GputqTimeoutError, InvalidInputError, MissingDependencyError
from gputq.kernels import cuda_available
from gputq.tools.capacity import build_parser as capacity_parser
from gputq.tools.capacity import run
from gputq.tools.demo import DemoOptions, demo_bytes, run_demo
from gputq.tools.info import collect_info, format_info
from gputq.tools.stats import run_stats
from gputq.transport.handler import MAX_TIMEOUT_S

__all__ = ["main", "build_parser"]

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class _Defaults(argparse.HelpFormatter):
    """Appends "(default: X)" to every option that has a default and does not already state it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".strip()


def _positive(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    fmt = _Defaults
    parser = _Parser(prog="gputq", description=__doc__.splitlines()[0], formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", formatter_class=fmt,
                          help="run the whole offload path on an embedded local Ray",
                          description="Synthetic SGLang responses -> StorageUnits -> slime samples -> "
                                      "trainer ranks, compared bit for bit with the inline path. Reads "
                                      "the same config file and GPUTQ_* variables as the library; flags win.")
    demo.add_argument("--sessions", type=_positive, default=8, help="synthetic rollout sessions")
    demo.add_argument("--steps", type=_positive, default=4, help="model calls per session")
    demo.add_argument("--units", type=_positive, default=None,
                      help="StorageUnits (default: the config's num_units)")
    demo.add_argument("--ranks", type=_positive, default=2, help="trainer data-parallel ranks")
    demo.add_argument("--dtype", choices=EXPERT_DTYPES, default=None,
                      help="stored expert-ID format (default: the config's routed_experts_dtype); packed and "
                           "auto use --experts")
    demo.add_argument("--layers", type=_positive, default=48, help="recorded MoE layers L")
    demo.add_argument("--topk", type=_positive, default=8, help="routing top-k K")
    demo.add_argument("--experts", type=_positive, default=128, help="experts per layer")
    demo.add_argument("--tokens", type=_positive, default=1024, help="output tokens per model call")
    demo.add_argument("--transport", choices=TRANSPORTS, default=None,
                      help="byte transport (default: the config's, auto unless set)")
    demo.add_argument("--device", default="cpu", help="trainer restore device: cpu or cuda[:N]")
    demo.add_argument("--view", choices=("timeline", "lineage"), default="lineage",
                      help="segments: one per step (timeline) or one per context (lineage)")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the synthetic rollout")
    demo.add_argument("--config", metavar="PATH", default=None,
                      help="gputq YAML config (default: $GPUTQ_CONFIG if set)")
    demo.add_argument("--overlap", action="store_true",
                      help="then run two overlapping rollouts (sessions carried over, groups filtered out)")
    demo.add_argument("--json", action="store_true", help="last line of output: one JSON object")

    info = sub.add_parser("info", formatter_class=fmt,
                          help="versions, transports, devices and what auto would choose")
    info.add_argument("--json", action="store_true")

    stats = sub.add_parser("stats", formatter_class=fmt, help="live table of a running deployment",
                           description="Attach to the Ray cluster of a running deployment and show its "
                                       "units: bytes held, keys, reads, writes, waits, expiries.")
    stats.add_argument("--address", default="auto", help="Ray address of the cluster")
    stats.add_argument("--interval", type=_seconds, default=2.0, help="seconds between refreshes")
    stats.add_argument("--once", action="store_true", help="print one table and exit")
    stats.add_argument("--json", action="store_true", help="print one JSON object and exit")
    stats.add_argument("--check", action="store_true",
                       help="run the controller's invariant check; exit 1 if it finds violations")

    capacity_parser(sub.add_parser("capacity", help="R3 bytes of a rollout and the master node's projected peak"))
    return parser


def demo_setup(args: argparse.Namespace, env=None):
    """Check the demo's arguments and build its options and config.

    Raises
    ------
    InvalidInputError or MissingDependencyError
        A bad argument or config value, or a missing dependency; ``main``
        reports either as one line with exit status 2.
    """
    env = os.environ if env is None else env
    config = GputqConfig.load(yaml_path=args.config, env=env)
    dtype = args.dtype or config.routed_experts_dtype
    if dtype in ROUTED_EXPERTS_DTYPES:
        top = int(np.iinfo(np.dtype(dtype)).max)
        if args.experts - 1 > top:
            raise InvalidInputError(f"--experts {args.experts}: expert IDs up to {args.experts - 1} do not fit {dtype} "
                                    f"(at most {top + 1} experts); pick --dtype "
                                    f"{'uint16' if dtype == 'uint8' else 'int32'}, packed or auto")
    if args.topk > args.experts:
        raise InvalidInputError(f"--topk {args.topk} is more than --experts {args.experts}")
    spec = routed_experts_spec(args.layers, args.topk, dtype, args.experts)  # packed at the demo's --experts
    stored = demo_bytes(args.sessions, args.steps, args.tokens, row_nbytes(spec))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 2 * stored > memory:  # the inline reference holds a copy beside the units' arenas
        raise InvalidInputError(f"the demo would store about {stored / 2**30:.1f} GiB of expert IDs twice, more "
                                f"than this machine's {memory / 2**30:.1f} GiB; lower --tokens, --sessions or --steps")
    device = args.device
    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise InvalidInputError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if device != "cpu":
        if not cuda_available():
            raise InvalidInputError(f"--device {device}: no usable CUDA device here (use --device cpu)")
    transport = args.transport or config.transport
    import_ray()  # a missing Ray or NIXL is a usage error here, before any process starts
    serving_transport(transport)
    options = DemoOptions(sessions=args.sessions, steps=args.steps, units=args.units or config.num_units,
                          ranks=args.ranks, dtype=dtype, layers=args.layers, topk=args.topk,
                          experts=args.experts, tokens=args.tokens, transport=transport, device=device,
                          view=args.view, seed=args.seed, overlap=args.overlap)
    return options, config


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (InvalidInputError, MissingDependencyError) as exc:
        print(f"gputq {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except GputqTimeoutError as exc:  # a peer that did not answer: one line, not a traceback
        print(f"gputq {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        options, config = demo_setup(args)
        result = run_demo(options, config=config, progress=not args.json)
        if args.json:
            print(json.dumps(result))
        return 0 if result["verified"] else 1
    if args.command == "capacity":
        return run(args)
    if args.command == "info":
        data = collect_info()
        print(json.dumps(data, default=str) if args.json else format_info(data))
        return 0
    if args.command == "stats":
        return run_stats(address=args.address, interval=args.interval, once=args.once or args.check,
                         as_json=args.json, check=args.check)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
