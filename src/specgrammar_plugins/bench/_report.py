"""What every benchmark shares: an output folder, JSON + PNG, a progress bar, medians and a markdown table.

    ap = argparse.ArgumentParser(...)
    add_common_args(ap, "strategies")            # --out-dir (default bench-out/strategies/), --quick
    rep = Report("strategies", args)             # makes the folder, records machine + argv + start time
    for _ in progress(items, "strategies"):      # tqdm on stderr (into a log or pipe: at most every 30 s)
        ...
    rep.write(payload, plot=lambda ax: ...)      # <out-dir>/<name>.json and <name>.png; returns the paths

The JSON holds ``machine`` (platform, ``nproc``, CPU model, load average), ``argv``, ``started`` (UTC ISO) and
``seconds`` besides the benchmark's own payload, so a result file says where and how it was made.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

DEFAULT_ROOT = Path("bench-out")


def add_common_args(ap, name: str) -> None:
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_ROOT / name,
                    help=f"folder for {name}.json and {name}.png (default {DEFAULT_ROOT / name})")
    ap.add_argument("--quick", action="store_true", help="a smoke run (under 2 minutes): fewer workloads and prompts")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


def machine() -> dict:
    """Where the run happened: platform, logical CPUs, CPU model, memory, load average."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "nproc": os.cpu_count()}
    try:
        info["nproc"] = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gb"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    if hasattr(os, "getloadavg"):
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return info


def versions(*packages: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in packages:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


NON_TTY_INTERVAL_S = 30.0


def progress(items: Iterable, desc: str, total: int | None = None, disable: bool = False):
    """A tqdm bar on stderr over ``items``.  Where stderr is not a terminal (a log file, a pipe, CI) the bar is
    redrawn at most every ``NON_TTY_INTERVAL_S`` seconds: each redraw is a new carriage-return line in the log, and at
    tqdm's default 10 per second a long benchmark filled its log with them."""
    from tqdm import tqdm

    tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
    return tqdm(items, desc=desc, total=total, disable=disable, file=sys.stderr, dynamic_ncols=True, leave=False,
                mininterval=0.1 if tty else NON_TTY_INTERVAL_S)


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A GitHub markdown table; columns whose index is in ``right`` are right-aligned."""
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def finite_numbers(obj) -> list[float]:
    """Every int/float (bools excluded) found in a JSON-like object, for smoke tests."""
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, (int, float)):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in finite_numbers(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in finite_numbers(v)]
    return []


class Report:
    """One benchmark run's output folder and metadata."""

    def __init__(self, name: str, args=None, argv: Sequence[str] | None = None):
        self.name = name
        self.dir = Path(getattr(args, "out_dir", None) or DEFAULT_ROOT / name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.argv = list(argv if argv is not None else sys.argv[1:])
        self.started = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
        self.t0 = time.perf_counter()
        self.machine = machine()

    @property
    def json_path(self) -> Path:
        return self.dir / f"{self.name}.json"

    @property
    def png_path(self) -> Path:
        return self.dir / f"{self.name}.png"

    def write(self, payload: dict, plot: Callable | None = None, figsize=(10, 5)) -> list[Path]:
        """Write ``<name>.json`` (payload + metadata) and, given ``plot(fig)``, ``<name>.png``."""
        doc = {"benchmark": self.name, "started": self.started, "seconds": round(time.perf_counter() - self.t0, 1),
               "argv": self.argv, "machine": self.machine, **payload}
        self.json_path.write_text(json.dumps(doc, indent=1, default=_json_default))
        paths = [self.json_path]
        if plot is not None and save_plot(self.png_path, plot, figsize):
            paths.append(self.png_path)
        print("wrote " + ", ".join(str(p) for p in paths))
        return paths


def save_plot(path: Path, plot: Callable, figsize=(10, 5)) -> bool:
    """Draw ``plot(fig)`` into a PNG at ``path`` (Agg backend); False (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot {path}: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return False
    fig = plt.figure(figsize=figsize)
    try:
        plot(fig)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return True


def bar_groups(ax, groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, title: str = "",
               hline: float | None = None) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series."""
    import numpy as np

    n = max(len(series), 1)
    width = 0.8 / n
    x = np.arange(len(groups))
    for i, (label, ys) in enumerate(series.items()):
        vals = [y if y is not None and math.isfinite(y) else 0.0 for y in ys]
        ax.bar(x + (i - (n - 1) / 2) * width, vals, width, label=label)
    ax.set_xticks(x)
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    if hline is not None:
        ax.axhline(hline, color="gray", lw=0.8, ls="--")
    ax.legend(fontsize=7)


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)
