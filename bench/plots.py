"""The benchmarks' figures: matplotlib PNGs under docs/figures/.

matplotlib loads on first use (``pip install 'gputq[bench]'``); the
benchmarks call these after printing their tables, so a missing
matplotlib costs the figures, not the numbers.
"""

from __future__ import annotations

import os
from dataclasses import replace

__all__ = ["memory_figures", "capacity_figure", "peers_figure", "trainer_memory_figure", "write_figures"]

_MIB = 1 << 20
_COLORS = {"proxy": "#4c72b0", "rollout_manager": "#dd8452", "object_store": "#55a868",
           "controller": "#8172b3", "su-0": "#c44e52"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        from gputq.errors import MissingDependencyError

        raise MissingDependencyError("figures need matplotlib: pip install 'gputq[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_figures(draw, *args) -> list[str]:
    """Call ``draw(*args)`` and return the paths it wrote; without matplotlib, say so and return []."""
    import sys

    from gputq.errors import MissingDependencyError

    try:
        paths = draw(*args)
    except MissingDependencyError as exc:
        print(f"no figures: {exc}", file=sys.stderr)
        return []
    return [paths] if isinstance(paths, str) else list(paths)


def _save(fig, outdir: str, name: str) -> str:
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    return path


def memory_figures(result: dict, outdir: str) -> list[str]:
    """Timeline and per-component peaks (both paths, headline config), master share vs N, capacity."""
    plt = _pyplot()
    runs = result["runs"]
    central = runs[0]
    sized = [r for r in runs[1:] if r.get("arena", "sized") == "sized"]
    fixed = [r for r in runs[1:] if r.get("arena") == "fixed"]
    head = next((r for r in sized if (r["units"], r["dtype"]) ==
                 (result["headline"]["units"], result["headline"]["dtype"])), runs[-1])
    return [_timeline_figure(plt, central, head, outdir),
            _peaks_figure(plt, central, head, result["master_peak_ratio"], outdir),
            _share_figure(plt, central, sized, fixed, outdir),
            capacity_figure(result["calibration"], outdir)]


def _timeline_figure(plt, central: dict, head: dict, outdir: str) -> str:
    """The master node's memory over time, centralised beside gputq's headline run."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, run, title in ((axes[0], central, "centralised (int32 inline)"),
                           (axes[1], head, f"gputq ({head['units']} units, {head['dtype']})")):
        names = [n for n in _COLORS if n in run["components"]]
        t = [s[0] for s in run["timeline"]]
        ax.stackplot(t, *[[s[1].get(n, 0) / _MIB for s in run["timeline"]] for n in names],
                     labels=[n.replace("su-0", "local unit (su-0)") for n in names],
                     colors=[_COLORS[n] for n in names], alpha=0.85)
        for at, label in run["marks"]:
            ax.axvline(at, color="grey", lw=0.6, ls=":")
            ax.text(at, ax.get_ylim()[1] * 0.02, label, rotation=90, fontsize=7, color="grey", va="bottom")
        ax.set_title(title)
        ax.set_xlabel("seconds")
    axes[0].set_ylabel("master-node trajectory MiB (above idle)")
    axes[1].legend(loc="upper right", fontsize=8)
    return _save(fig, outdir, "memory_timeline.png")


def _peaks_figure(plt, central: dict, head: dict, ratio: float, outdir: str) -> str:
    """Each master-node component's peak, centralised beside gputq's headline run."""
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(_COLORS)
    width = 0.38
    for i, (run, label) in enumerate(((central, "centralised"), (head, f"gputq {head['units']}x{head['dtype']}"))):
        values = [run["components"].get(n, {}).get("data", 0) / _MIB for n in names] + \
            [run["master_data"] / _MIB]
        ax.bar([x + (i - 0.5) * width for x in range(len(values))], values, width, label=label)
    ax.set_xticks(range(len(names) + 1), [n.replace("rollout_manager", "rollout\nmanager") for n in names] +
                  ["master\ntotal"], fontsize=8)
    ax.set_ylabel("peak MiB (above idle)")
    ax.set_title(f"master-node peaks; gputq/centralised = {ratio:.3f}")
    ax.legend()
    return _save(fig, outdir, "memory_peaks.png")


def _share_figure(plt, central: dict, sized: list, fixed: list, outdir: str) -> str:
    """The master's peak under gputq against the centralised one, as the units grow."""
    fig, ax = plt.subplots(figsize=(6, 4))
    units = sorted({r["units"] for r in sized})
    for dtype in sorted({r["dtype"] for r in sized}):
        share = [next(r["master_data"] for r in sized if r["units"] == n and r["dtype"] == dtype) /
                 central["master_data"] for n in units]
        ax.plot(units, share, marker="o", label=f"{dtype}, arenas sized to the run")
    for r in fixed:
        ax.plot([r["units"]], [r["master_data"] / central["master_data"]], marker="x", ls="none",
                label=f"{r['dtype']}, arenas fixed at {r['capacity_per_unit'] // _MIB} MiB")
    if units:
        first = next(r for r in sized if r["units"] == units[0])
        ax.plot(units, [first["master_data"] / central["master_data"] * units[0] / n for n in units],
                ls="--", color="grey", label=f"1/N from N={units[0]} ({first['dtype']})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(units, [str(n) for n in units])
    ax.set_xlabel("StorageUnits N")
    ax.set_ylabel("master peak, gputq / centralised")
    ax.set_title("master share against N")
    ax.legend()
    return _save(fig, outdir, "memory_share_vs_units.png")


def capacity_figure(calibration: dict, outdir: str) -> str:
    """The 744B-A40B projection against batch size, with the 2 TB host-memory line."""
    from gputq.tools.capacity import DEFAULT_HOST_BYTES, PRESETS, TIB, Calibration, master_peak_bytes

    plt = _pyplot()
    cal = Calibration(calibration["centralised"], calibration["residual"], calibration["local_unit"])
    base = PRESETS["744b-a40b"]
    prompts = list(range(16, 1025, 16))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(prompts, [master_peak_bytes(replace(base, prompts=p), cal, offload=False) / TIB for p in prompts],
            label="without offload (int32 inline)")
    for units, dtype in ((2, "int32"), (32, "uint16")):
        ax.plot(prompts, [master_peak_bytes(replace(base, prompts=p, units=units, dtype=dtype), cal,
                                            offload=True) / TIB for p in prompts],
                label=f"gputq, {units} units, {dtype}")
    ax.axhline(DEFAULT_HOST_BYTES / TIB, color="black", ls="--", lw=1, label="host memory 2 TB")
    ax.scatter([512, 512], [3.84, 0.33], marker="x", color="grey", zorder=3, label="published (512 prompts)")
    ax.set_xlabel("prompts per rollout (x 8 samples, 256K tokens, 75 layers, top-8)")
    ax.set_ylabel("master peak, TiB")
    ax.set_title(f"744B-A40B master-node projection; per R3 byte: centralised {cal.centralised:.3g}, "
                 f"residual {cal.residual:.3g}, local unit {cal.local_unit:.3g}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, outdir, "capacity_curve.png")


def peers_figure(result: dict, outdir: str) -> str:
    """Put and get bandwidth against shard size, one line per system."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, op in zip(axes, ("get", "put")):
        for system in result["systems"]:
            rows = [r for r in result["rows"] if r["system"] == system and r.get(f"{op}_GBps") is not None]
            if rows:
                ax.plot([r["shard_MiB"] for r in rows], [r[f"{op}_GBps"] for r in rows], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shard MiB")
        ax.set_title(op)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    return _save(fig, outdir, "peers_bandwidth.png")


def trainer_memory_figure(result: dict, outdir: str) -> str:
    """A reader's peak RSS against shard size: streamed slices and today's whole-shard fetch."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for path, label in (("whole", "whole-shard fetch"), ("stream", "streamed slices")):
        rows = [r for r in result["memory_rows"] if r["path"] == path]
        ax.plot([r["scale"] for r in rows], [r["peak_rss_MiB"] for r in rows], marker="o", label=label)
    ax.set_xlabel("shard size (x the 1x shard)")
    ax.set_ylabel("peak anonymous RSS above start, MiB")
    ax.set_title(f"rank dp0/pp0/cp0 of DP {result['dp']} x PP {result['pp']} x CP {result['cp']}, "
                 f"{result['transport']}")
    ax.legend()
    return _save(fig, outdir, "trainer_memory.png")
