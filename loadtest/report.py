"""What every benchmark report of this folder states: machine, load, versions, date, command; and
the CSV, Markdown and figure writers they share."""

from __future__ import annotations

import csv
import datetime as dt
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def versions(*names: str) -> str:
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join([f"Python {platform.python_version()}", *found])


def header(title: str, packages: tuple[str, ...], load_before: str) -> list[str]:
    """Markdown lines: title, date, exact command, machine, versions, load average before and now."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *_invocation(), *sys.argv[1:]])
    return [
        f"# {title}",
        "",
        f"- date: {now}",
        f"- command: `{command}`",
        f"- machine: {platform.system()} {platform.release()}, {cpu_model()}, {os.cpu_count()} CPUs, "
        f"{memory_gib():.0f} GiB RAM",
        f"- versions: {versions(*packages)}",
        f"- load average at start: {load_before}; at the end: {load_average()}",
        "",
    ]


def _invocation() -> list[str]:
    """`-m module` when run as a module, else the script's path as typed (benchmarks/*.py are scripts)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return ["-m", spec.name] if spec is not None else [sys.argv[0]]


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)


def write_markdown(path: Path, lines: list[str], echo: bool = True) -> None:
    """Writes the report's lines joined by newlines (no newline added at the end) and, with `echo`, prints them
    too, so a run's figures show in its log without opening the file."""
    text = "\n".join(lines)
    path.write_text(text)
    if echo:
        print(text)


def agg_subplots(*args: Any, **kwargs: Any) -> tuple[Figure, Any]:
    """`plt.subplots` on the Agg backend: benchmarks run on machines without a display. matplotlib is imported here,
    not at the top, so that importing this module stays cheap where matplotlib is not needed (export/calibrate.py;
    loadtest/table3.py, which locust imports)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig: Figure, path: Path, dpi: int) -> None:
    """Lays the figure out, writes it at `dpi` and closes it, so a process that plots more than once does not keep
    every figure in memory."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def markdown_table(rows: list[dict], columns: dict[str, str]) -> list[str]:
    """`columns` maps row keys to headers; floats print with 3 significant digits, None as "–"."""

    def cell(value) -> str:
        if value is None or value == "":
            return "–"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(key)) for key in columns) + " |" for row in rows]
    return lines
