"""``gputq capacity``: how many bytes of routed-expert IDs a rollout makes, and where they sit.

The analytical model is exact arithmetic on the shape of a rollout::

    S_R3 = sum over segments of T × L × K × D

T tokens of a segment, L recorded MoE layers, K routing top-k, D bytes per
ID. With ``prompts × samples_per_prompt`` trajectories of ``segments``
segments of ``context`` tokens each, that is their product. No
measurement enters it.

The master-node projection does use measurements: how many bytes the
master holds, at its peak, per byte of R3 payload (:class:`Calibration`).
``python -m bench.memory --json`` measures them on the machine at hand;
the defaults here come from its committed run (docs/logs/). Without
offload the master holds ``centralised × S_R3`` (the IDs travel as int32
whatever the stored dtype, as the trainer expects them); with offload it
holds ``residual × S_R3`` (references, samples, buffers) plus its local
StorageUnit, ``local_unit × S_stored / units``.

docs/capacity.md derives the published figures from this model and says
how close the calibrated projection lands.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from gputq.data.packing import bits_for, packed_row_bytes
from gputq.errors import ConfigError

__all__ = [
    "BYTES_PER_ID",
    "PRESETS",
    "Calibration",
    "DEFAULT_CALIBRATION",
    "RolloutShape",
    "parse_tokens",
    "r3_bytes",
    "layer_row_bytes",
    "CAPACITY_DTYPES",
    "growth",
    "local_unit_increment",
    "master_peak_bytes",
    "threshold_prompts",
    "project",
    "PUBLISHED",
    "reference_figures",
    "build_parser",
    "main",
]

BYTES_PER_ID = {"uint8": 1, "uint16": 2, "int32": 4}
#: Stored expert-ID formats the planner knows: whole bytes, or ``packed`` at ``ceil(log2 E)`` bits.
CAPACITY_DTYPES = (*BYTES_PER_ID, "packed")
TIB = 1 << 40
GIB = 1 << 30
#: The host-memory line of the published threshold: 2 TB (decimal) per master node.
DEFAULT_HOST_BYTES = 2 * 10**12


@dataclass(frozen=True)
class RolloutShape:
    """One rollout batch: what ``S_R3`` is computed from.

    ``token_lengths``, when given, lists the token count of every segment of
    the batch and replaces ``context × segments × prompts × samples_per_prompt``.
    """

    context: int = 256 * 1024
    segments: float = 1.0
    layers: int = 75
    topk: int = 8
    dtype: str = "int32"
    prompts: int = 512
    samples_per_prompt: int = 8
    units: int = 32
    token_lengths: tuple[int, ...] | None = None
    experts: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in CAPACITY_DTYPES:
            raise ConfigError(f"dtype must be one of {list(CAPACITY_DTYPES)}, got {self.dtype!r}")
        if self.experts is not None:
            bits_for(self.experts)  # a ConfigError beyond 65,536 experts
            if self.dtype in BYTES_PER_ID and self.experts - 1 > _LARGEST_ID[self.dtype]:
                raise ConfigError(f"{self.experts} experts do not fit {self.dtype} IDs; pick a wider dtype or packed")
        elif self.dtype == "packed":
            raise ConfigError("dtype packed needs the expert count (--experts): its width is ceil(log2 E) bits")
        for name in ("context", "layers", "topk", "prompts", "samples_per_prompt", "units"):
            if not 1 <= int(getattr(self, name)) <= _MAX_COUNT:
                raise ConfigError(f"{name} must be in [1, {_MAX_COUNT:g}], got {getattr(self, name)}")
        if not (math.isfinite(self.segments) and 0 < self.segments <= _MAX_COUNT):
            raise ConfigError(f"segments must be a finite number in (0, {_MAX_COUNT:g}], got {self.segments}")

    @property
    def trajectories(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def tokens(self) -> float:
        """Tokens of every segment of the batch together."""
        if self.token_lengths is not None:
            return float(sum(self.token_lengths))
        return float(self.trajectories) * self.segments * self.context


_LARGEST_ID = {"uint8": 255, "uint16": 65535, "int32": 2**31 - 1}
#: The largest count (tokens, layers, prompts, ...) a projection takes: beyond it figures are no rollout's.
_MAX_COUNT = 10**9


#: The two models of the reference write-up.
PRESETS = {
    # The measured run: a 35B-A3B model, 40 recorded MoE layers, 64K context.
    "35b-a3b": RolloutShape(context=64 * 1024, layers=40, topk=8, units=2),
    # The projection: a 744B-A40B model, 75 recorded MoE layers, 256K context.
    "744b-a40b": RolloutShape(context=256 * 1024, layers=75, topk=8, units=32),
}


@dataclass(frozen=True)
class Calibration:
    """Master-node bytes at peak per byte of R3 payload, measured by ``bench.memory``.

    Attributes
    ----------
    centralised:
        Without offload: master peak (proxy + rollout manager + object store)
        per int32 R3 byte.
    residual:
        With offload: master peak outside its local StorageUnit per int32 R3 byte.
    local_unit:
        With offload: the local unit's bytes per byte it stores (1 plus arena headroom).
    source:
        Where the figures come from.
    """

    centralised: float
    residual: float
    local_unit: float
    source: str = ""

    def __post_init__(self) -> None:
        for name, low in (("centralised", 0.0), ("residual", None), ("local_unit", 0.0)):
            value = getattr(self, name)  # residual may be 0: an offloaded master holding no R3 bytes
            if not (math.isfinite(value) and (value >= 0 if low is None else value > low)):
                raise ConfigError(f"{self.source or 'calibration'}: {name} must be a finite number "
                                  f"{'>= 0' if low is None else '> 0'}, got {value}")

    @classmethod
    def from_bench(cls, path: str) -> "Calibration":
        """Read the ``calibration`` object of the last ``bench.memory --json`` line in ``path``.

        A committed log (command line first, status after) reads as well as the bare output.
        """
        lines = [line for line in _text(path).splitlines() if line.startswith("{")]
        for line in reversed(lines):
            try:
                data = json.loads(line)["calibration"]
                return cls(float(data["centralised"]), float(data["residual"]), float(data["local_unit"]),
                           source=path)
            except ConfigError:
                raise  # a calibration line with figures no run can give
            except (KeyError, TypeError, ValueError):
                continue
        raise ConfigError(f"{path}: no bench.memory --json line with a calibration in it")


#: From ``python -m bench.memory --scale 4 --units 2 --dtypes uint16 --json`` on the 2-core dev
#: box, 2026-11-30 (docs/logs/memory-scale4-2026-11-30.log): the largest batch measured, whose
#: fixed per-session costs weigh least per R3 byte. Rerun it and pass ``--calibration`` elsewhere.
DEFAULT_CALIBRATION = Calibration(centralised=2.0398, residual=0.03724, local_unit=1.1055,
                                  source="bench.memory --scale 4, dev box, 2026-11-30")


_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}


def parse_tokens(text: str) -> int:
    """``"256K"`` -> 262144, ``"64k"`` -> 65536, ``"1M"`` -> 1048576, ``"5000"`` -> 5000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not match:
        raise ConfigError(f"not a token count: {text!r} (e.g. 256K, 65536)")
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise ConfigError(f"not a whole positive token count: {text!r}")
    return int(value)


def read_token_lengths(path: str) -> tuple[int, ...]:
    """Token counts of every segment of a batch: whitespace- or comma-separated integers."""
    words = _text(path).replace(",", " ").split()
    try:
        lengths = tuple(int(w) for w in words)
    except ValueError:
        raise ConfigError(f"{path}: expected integers (token counts), one per segment") from None
    if not lengths or min(lengths) < 1 or max(lengths) > _MAX_COUNT:
        raise ConfigError(f"{path}: needs at least one segment, each of 1 to {_MAX_COUNT:g} tokens")
    return lengths


def _text(path: str) -> str:
    """The text of ``path``; ``ConfigError`` for a file that is not UTF-8 text."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from None


def layer_row_bytes(shape: RolloutShape, dtype: str | None = None) -> int:
    """Stored bytes of one token's K IDs of one layer: ``K × D``, or packed ``ceil(K × ceil(log2 E) / 8)``."""
    dtype = dtype or shape.dtype
    if dtype == "packed":
        return packed_row_bytes(shape.topk, bits_for(shape.experts))
    return shape.topk * BYTES_PER_ID[dtype]


def r3_bytes(shape: RolloutShape, dtype: str | None = None) -> float:
    """``S_R3 = Σ T × L × (one layer's row bytes)`` of the batch, with ``dtype`` overriding the shape's."""
    return shape.tokens * shape.layers * layer_row_bytes(shape, dtype)


def growth(base: RolloutShape, target: RolloutShape) -> float:
    """How many times the R3 bytes of ``base`` the ``target`` batch makes."""
    return r3_bytes(target) / r3_bytes(base)


def local_unit_increment(base: RolloutShape, target: RolloutShape) -> float:
    """What the master's local unit holds for ``target`` over what it held for ``base``.

    Each unit holds ``S_R3 / units``: the payload grows by :func:`growth`
    while the share of one unit shrinks with the unit count.
    """
    return (r3_bytes(target) / target.units) / (r3_bytes(base) / base.units)


def master_peak_bytes(shape: RolloutShape, calibration: Calibration, *, offload: bool) -> float:
    """The master node's projected peak of trajectory bytes."""
    carried = r3_bytes(shape, "int32")  # without offload the IDs travel restored, as int32
    if not offload:
        return calibration.centralised * carried
    return calibration.residual * carried + calibration.local_unit * r3_bytes(shape) / shape.units


def threshold_prompts(shape: RolloutShape, calibration: Calibration, host_bytes: float, *,
                      offload: bool) -> float:
    """The batch size (prompts) at which the master peak reaches ``host_bytes`` (linear in prompts)."""
    per_prompt = master_peak_bytes(shape, calibration, offload=offload) / shape.prompts
    return host_bytes / per_prompt


def project(shape: RolloutShape, calibration: Calibration = DEFAULT_CALIBRATION,
            host_bytes: float = DEFAULT_HOST_BYTES) -> dict:
    """Every figure ``gputq capacity`` prints, as one JSON-able dict."""
    without = master_peak_bytes(shape, calibration, offload=False)
    with_offload = master_peak_bytes(shape, calibration, offload=True)
    return {
        "shape": {k: v for k, v in asdict(shape).items() if k != "token_lengths"},
        "segments_from_file": len(shape.token_lengths) if shape.token_lengths else None,
        "tokens": shape.tokens,
        "layer_row_bytes": layer_row_bytes(shape),
        "token_row_bytes": shape.layers * layer_row_bytes(shape),
        "r3_bytes": r3_bytes(shape),
        "r3_bytes_int32": r3_bytes(shape, "int32"),
        "r3_bytes_per_unit": r3_bytes(shape) / shape.units,
        "master_peak_bytes": {"without_offload": without, "with_offload": with_offload},
        "master_peak_ratio": with_offload / without,
        "host_bytes": host_bytes,
        "threshold_prompts": {
            "without_offload": threshold_prompts(shape, calibration, host_bytes, offload=False),
            "with_offload": threshold_prompts(shape, calibration, host_bytes, offload=True),
        },
        "calibration": asdict(calibration),
    }


#: The reference write-up's figures for the 744B-A40B projection at 512 prompts.
PUBLISHED = {"master_peak_without_offload_tib": 3.84, "threshold_prompts_2tb": 243,
             "master_peak_uint16_32_units_tib": 0.33}


def reference_figures(calibration: Calibration = DEFAULT_CALIBRATION) -> dict:
    """The write-up's figures, exact ones from the model and projected ones beside the published.

    ``analytical`` depends on no measurement; ``projected`` uses
    ``calibration`` and sits next to ``published`` so the gap is plain.
    """
    small, large = PRESETS["35b-a3b"], PRESETS["744b-a40b"]
    compact = replace(large, dtype="uint16")
    return {
        "analytical": {
            "r3_tib_744b_256k_4096": r3_bytes(large) / TIB,
            "r3_tib_10_segments": r3_bytes(replace(large, segments=10)) / TIB,
            "growth_35b_to_744b": growth(small, large),
            "local_unit_increment": local_unit_increment(small, large),
            "local_unit_increment_uint16": local_unit_increment(small, compact),
        },
        "projected": {
            "master_peak_without_offload_tib": master_peak_bytes(large, calibration, offload=False) / TIB,
            "threshold_prompts_2tb": threshold_prompts(large, calibration, DEFAULT_HOST_BYTES, offload=False),
            "master_peak_uint16_32_units_tib": master_peak_bytes(compact, calibration, offload=True) / TIB,
        },
        "published": dict(PUBLISHED),
        "calibration": asdict(calibration),
    }


def format_reference(ref: dict) -> str:
    """The readable form of :func:`reference_figures`."""
    a, p, pub = ref["analytical"], ref["projected"], ref["published"]
    lines = ["  exact (model only):",
             f"    256K x 75 x 8 x 4 B x 4,096   {a['r3_tib_744b_256k_4096']:.5f} TiB",
             f"    the same at 10 segments       {a['r3_tib_10_segments']:.4f} TiB",
             f"    35B-A3B -> 744B-A40B growth   {a['growth_35b_to_744b']:.4g}x",
             f"    local unit, 2 -> 32 units     {a['local_unit_increment']:.5g}x "
             f"({a['local_unit_increment_uint16']:.5g}x with uint16)",
             "  projected (calibrated)  vs published:"]
    for key, label, fmt in (("master_peak_without_offload_tib", "master peak, no offload, 512", "{:.3g} TiB"),
                            ("threshold_prompts_2tb", "prompts at 2 TB", "{:.0f}"),
                            ("master_peak_uint16_32_units_tib", "master peak, uint16, 32 units", "{:.3g} TiB")):
        lines.append(f"    {label:<30} {fmt.format(p[key]):>10}  vs {fmt.format(pub[key]):>9}  "
                     f"({p[key] / pub[key]:.2f}x)")
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    if nbytes >= TIB:
        return f"{nbytes / TIB:.5g} TiB"
    return f"{nbytes / GIB:.4g} GiB"


def _id_format(s: dict) -> str:
    if s["dtype"] == "packed":
        return f"packed {bits_for(s['experts'])}-bit IDs ({s['experts']} experts)"
    return f"{s['dtype']} ({BYTES_PER_ID[s['dtype']]} B)"


def format_projection(p: dict) -> str:
    """The readable table of :func:`project`'s output."""
    s = p["shape"]
    source = (f"{p['segments_from_file']} segments from the file" if p["segments_from_file"] else
              f"{s['prompts']} prompts x {s['samples_per_prompt']} samples x {s['segments']:g} segments "
              f"x {s['context']} tokens")
    peak, thr = p["master_peak_bytes"], p["threshold_prompts"]
    rows = [
        ("batch", source),
        ("row", f"L={s['layers']} x K={s['topk']} x {_id_format(s)}: {p['layer_row_bytes']} B per layer, "
                f"{p['token_row_bytes']} B per token"),
        ("S_R3", f"{_size(p['r3_bytes'])} ({p['r3_bytes']:.6g} B)"),
        ("S_R3 as int32 (carried)", _size(p["r3_bytes_int32"])),
        (f"per unit ({s['units']} units)", _size(p["r3_bytes_per_unit"])),
        ("master peak, no offload", _size(peak["without_offload"])),
        ("master peak, offload", f"{_size(peak['with_offload'])} ({p['master_peak_ratio']:.3f}x)"),
        (f"prompts to fill {p['host_bytes'] / 1e12:g} TB",
         f"{thr['without_offload']:.0f} without offload, {thr['with_offload']:.0f} with"),
        ("calibration", f"{p['calibration']['centralised']:.3g} / {p['calibration']['residual']:.3g} / "
                        f"{p['calibration']['local_unit']:.3g} per byte ({p['calibration']['source']})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the ``capacity`` flags to ``parser`` (a new one when None) and return it."""
    parser = parser or argparse.ArgumentParser(prog="gputq capacity", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="744b-a40b",
                        help="start from a model of the reference write-up; flags override it")
    parser.add_argument("--context", help="tokens per segment (e.g. 256K), or a file of segment token counts")
    parser.add_argument("--segments", type=float, help="mean segments per trajectory")
    parser.add_argument("--layers", type=int, help="recorded MoE layers L")
    parser.add_argument("--topk", type=int, help="routing top-k K")
    parser.add_argument("--dtype", choices=CAPACITY_DTYPES, help="stored expert-ID format (packed needs --experts)")
    parser.add_argument("--experts", type=int, help="experts per layer E (packed IDs take ceil(log2 E) bits)")
    parser.add_argument("--prompts", type=int, help="prompts per rollout batch")
    parser.add_argument("--samples-per-prompt", type=int, help="trajectories per prompt")
    parser.add_argument("--units", type=int, help="StorageUnits (one is the master's own)")
    parser.add_argument("--host-tb", type=float, default=DEFAULT_HOST_BYTES / 1e12,
                        help="master host memory in TB (10**12 bytes) for the threshold")
    parser.add_argument("--calibration", help="a bench.memory --json output to calibrate from")
    parser.add_argument("--reference", action="store_true",
                        help="print the reference write-up's figures: exact ones and calibrated projections")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def shape_from_args(args: argparse.Namespace) -> RolloutShape:
    """The preset with every given flag applied."""
    overrides = {name: getattr(args, name) for name in
                 ("segments", "layers", "topk", "dtype", "prompts", "samples_per_prompt", "units", "experts")
                 if getattr(args, name) is not None}
    if args.context is not None:
        if os.path.isfile(args.context):
            overrides["token_lengths"] = read_token_lengths(args.context)
        else:
            overrides["context"] = parse_tokens(args.context)
    return replace(PRESETS[args.preset], **overrides)


def run(args: argparse.Namespace) -> int:
    """Print the projection for parsed ``args``; returns the exit status."""
    try:
        calibration = Calibration.from_bench(args.calibration) if args.calibration else DEFAULT_CALIBRATION
        if not (math.isfinite(args.host_tb) and 0 < args.host_tb <= _MAX_COUNT):
            raise ConfigError(f"--host-tb must be a finite number of TB in (0, {_MAX_COUNT:g}], got {args.host_tb}")
        result = project(shape_from_args(args), calibration, args.host_tb * 1e12)
    except (ConfigError, OSError) as exc:
        print(f"gputq capacity: {exc}", file=sys.stderr)
        return 2
    if args.reference:
        result["reference"] = reference_figures(calibration)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(format_projection(result))
    if args.reference:
        print(format_reference(result["reference"]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gputq.tools.capacity``, the same as ``gputq capacity``."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
