#!/usr/bin/env python3
"""Draw the panels of the Grafana dashboard from a live Prometheus into one PNG.

Every target of every panel in deploy/monitoring/dashboard.json runs as a range query (an
instant one at the window's end where the target says `instant`); the panels keep the
dashboard's grid (24 columns), titles, units, legends and threshold lines, so the picture
shows what Grafana would, without a Grafana (time series, stats and bar gauges). Template
variables ($job, $instance) default to every value (.+), and $__rate_interval is worked
out the way Grafana does it, from the step and the scrape interval.

    scripts/render-dashboard.py --prometheus http://127.0.0.1:9090 --out dashboard.png \\
        [--minutes 15 | --start UNIX --end UNIX] [--scrape-interval 15] \\
        [--var job=sglang-gateway] [--require-data]

Prints one line per panel with the number of series it got; with --require-data the exit
status is 1 when some panel got none.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: a file is the only output

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.gridspec import GridSpec

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "monitoring" / "dashboard.json"
GRID_COLUMNS = 24  # Grafana's grid
FIGURE_WIDTH = 20  # inches
LEGEND_ROWS = 2  # grid rows below a time series kept for its legend
# Characters Grafana escapes in a variable value used in a regex matcher, and how: the
# backslash is doubled again inside PromQL's double-quoted string.
_REGEX_SPECIAL = re.compile(r"([\\^$*+?.()|{}\[\]])")
# Grafana's named colours, as its default theme draws them.
COLORS = {"green": "#37872d", "red": "#c4162a", "orange": "#fa6400", "blue": "#1f60c4"}


@dataclass
class Series:
    legend: str
    times: list[dt.datetime]
    values: list[float]


def regex_value(values: list[str]) -> str:
    """A multi-value variable as Grafana writes it into a =~ matcher."""
    escaped = [_REGEX_SPECIAL.sub(r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def duration(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds))}s"


def expand(expr: str, variables: dict[str, str], builtins: dict[str, str]) -> str:
    """The query with every $name and ${name} replaced, longest names first (so $__range
    does not eat the start of $__range_s)."""
    values = {**variables, **builtins}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    if "$" in expr:
        raise ValueError(f"unknown variable left in {expr!r}")
    return expr


def api(base: str, path: str, **params: Any) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{base}/api/v1/{path}?{query}", timeout=30) as r:
        reply = json.load(r)
    if reply.get("status") != "success":
        raise RuntimeError(f"{params.get('query')}: {reply.get('error')}")
    return reply["data"]["result"]


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[Any]:
    return list(api(base, "query_range", query=expr, start=start, end=end, step=step))


def query_instant(base: str, expr: str, at: float) -> list[Any]:
    """An instant query's vector, each sample as a range result of one point."""
    return [
        {"metric": r["metric"], "values": [r["value"]]}
        for r in api(base, "query", query=expr, time=at)
    ]


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def fetch_panel(
    panel: dict[str, Any], base: str, variables: dict[str, str], window: tuple[float, float, float]
) -> list[Series]:
    start, end, step = window
    out = []
    for target in panel.get("targets", []):
        if target.get("instant"):
            results = query_instant(base, target["expr"], end)
        else:
            results = query_range(base, target["expr"], start, end, step)
        for result in results:
            points = [(float(t), float(v)) for t, v in result["values"]]
            out.append(
                Series(
                    legend(target.get("legendFormat", ""), result["metric"]),
                    [dt.datetime.fromtimestamp(t, dt.UTC) for t, _ in points],
                    [v for _, v in points],
                )
            )
    return out


def _seconds(value: float, _pos: float) -> str:
    if value == 0:
        return "0"
    if abs(value) < 1:
        return f"{value * 1000:g} ms"
    return f"{value:g} s"


_IEC = ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB"), (1, "B"))


def bytes_axis(ax: Axes) -> None:
    """Grafana's "bytes" unit: IEC multiples, ticks at round numbers of the unit the axis
    top is in."""
    top = ax.get_ylim()[1]
    size, name = next(((size, name) for size, name in _IEC if top >= size), _IEC[-1])
    ticks = ticker.MaxNLocator(5).tick_values(0, top / size)
    ax.set_yticks([t * size for t in ticks if 0 <= t * size <= top])
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v / size:g} {name}"))


def format_axis(ax: Axes, unit: str) -> None:
    if unit == "s":
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(_seconds))
    elif unit == "bytes":
        bytes_axis(ax)
    elif unit == "percentunit":
        ax.yaxis.set_major_formatter(ticker.PercentFormatter(1.0))
    elif unit == "reqps":
        ax.set_ylabel("req/s", fontsize=7)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(5))
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def draw_timeseries(
    ax: Axes, panel: dict[str, Any], series: list[Series], window: tuple[float, float, float]
) -> None:
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    bars = defaults.get("custom", {}).get("drawStyle") == "bars"
    start, end, step = window
    width = dt.timedelta(seconds=step) / max(1, len(series))
    for i, s in enumerate(series):
        if bars:
            # From the step, not the points: a filtered query (`> 0`) leaves gaps.
            ax.bar([t + width * i for t in s.times], s.values, width=width, label=s.legend)
        else:
            ax.plot(s.times, s.values, linewidth=1.2, label=s.legend)
    if defaults.get("custom", {}).get("thresholdsStyle", {}).get("mode") == "line":
        for step in defaults.get("thresholds", {}).get("steps", []):
            if step["value"] is not None:
                ax.axhline(
                    step["value"],
                    color=COLORS.get(step["color"], step["color"]),
                    linestyle="--",
                    linewidth=1,
                )
    ax.set_xlim(*(dt.datetime.fromtimestamp(t, dt.UTC) for t in (start, end)))  # one for all
    # From 0, with headroom above the highest point (a flat line would sit on the frame).
    top = max((v for s in series for v in s.values if math.isfinite(v)), default=0.0)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    format_axis(ax, defaults.get("unit", ""))
    if series:
        # As many columns as the longest name lets fit in the panel's width.
        longest = max(len(s.legend) for s in series)
        inches = FIGURE_WIDTH * panel["gridPos"]["w"] / GRID_COLUMNS
        columns = max(1, min(len(series), int(inches / (0.055 * longest + 0.45))))
        ax.legend(
            loc="upper left",
            bbox_to_anchor=(0, -0.12),
            ncol=columns,
            fontsize=7 if math.ceil(len(series) / columns) <= 3 else 6,
            frameon=False,
        )
    else:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)


def stat_color(panel: dict[str, Any], value: float) -> str:
    steps = panel["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
    color = "green"
    for step in steps:
        if step["value"] is None or value >= step["value"]:
            color = step["color"]
    return COLORS.get(color, color)


def field_color(panel: dict[str, Any], name: str) -> str:
    """A series' fixed colour: the last override whose byRegexp matcher takes its name,
    else the panel's default."""
    config = panel["fieldConfig"]
    color = config["defaults"].get("color", {}).get("fixedColor", "blue")
    for override in config.get("overrides", []):
        matcher = override["matcher"]
        if matcher["id"] == "byRegexp" and re.search(matcher["options"], name):
            for prop in override["properties"]:
                if prop["id"] == "color":
                    color = prop["value"].get("fixedColor", color)
    return COLORS.get(color, color)


def draw_bargauge(ax: Axes, panel: dict[str, Any], series: list[Series]) -> None:
    """Horizontal bars, one per series (its last value), in the order the query gave."""
    shown = [
        (s.legend, next((v for v in reversed(s.values) if not math.isnan(v)), 0.0)) for s in series
    ]
    if not shown:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)
        return
    # Grafana's horizontal bar gauge: the name on the left, inside the panel, then the bar.
    rows = range(len(shown))[::-1]  # the first series on top
    values = [v for _, v in shown]
    longest = max(values) or 1.0
    inches = FIGURE_WIDTH * panel["gridPos"]["w"] / GRID_COLUMNS
    names = (0.07 * max(len(name) for name, _ in shown) + 0.15) / inches  # of the width
    scale = (1 - names - 0.12) / longest
    decimals = panel["fieldConfig"]["defaults"].get("decimals")
    for row, (name, value) in zip(rows, shown, strict=True):
        color = field_color(panel, name)
        ax.barh(row, 1 - names - 0.12, left=names, height=0.7, color="#e6e6e6")
        ax.barh(row, value * scale, left=names, height=0.7, color=color)
        ax.text(names - 0.02, row, name, ha="right", va="center", fontsize=8)
        text = f"{value:.{decimals}f}" if decimals is not None else f"{value:.3g}"
        ax.text(1 - 0.1, row, text, ha="left", va="center", fontsize=9, color=color)
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.6, len(shown) - 0.4)
    ax.set_axis_off()


def draw_stat(ax: Axes, panel: dict[str, Any], series: list[Series]) -> None:
    ax.set_axis_off()
    unit = panel["fieldConfig"]["defaults"].get("unit", "")
    shown = [
        (s.legend, next((v for v in reversed(s.values) if not math.isnan(v)), None)) for s in series
    ]
    if not shown:
        ax.text(0.5, 0.4, "No data", ha="center", va="center", transform=ax.transAxes)
        return
    for i, (name, value) in enumerate(shown):
        x = (i + 0.5) / len(shown)
        text = "-" if value is None else f"{value:.3g}" + (" req/s" if unit == "reqps" else "")
        color = "grey" if value is None else stat_color(panel, value)
        ax.text(
            x,
            0.45,
            text,
            ha="center",
            va="center",
            fontsize=20,
            color=color,
            fontweight="bold",
            transform=ax.transAxes,
        )
        ax.text(x, 0.05, name, ha="center", va="bottom", fontsize=7, transform=ax.transAxes)


def render(
    dashboard: dict[str, Any],
    base: str,
    variables: dict[str, str],
    window: tuple[float, float, float],
    out: Path,
    *,
    shown: str,
) -> list[tuple[str, int]]:
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(FIGURE_WIDTH, rows * 0.36))
    grid = GridSpec(
        rows, GRID_COLUMNS, figure=fig, hspace=0.3, wspace=1.6, top=0.97, bottom=0.01, left=0.03
    )
    counts = []
    for panel in panels:
        pos = panel["gridPos"]
        x, y, w, h = pos["x"], pos["y"], pos["w"], pos["h"]
        if panel["type"] == "row":
            ax = fig.add_subplot(grid[y : y + h, x : x + w])
            ax.set_axis_off()
            ax.text(
                0,
                0.5,
                panel["title"],
                fontsize=12,
                fontweight="bold",
                va="center",
                transform=ax.transAxes,
            )
            continue
        series = fetch_panel(panel, base, variables, window)
        counts.append((panel["title"], len(series)))
        # The panel's first grid row holds its title, as in Grafana.
        if panel["type"] == "stat":
            ax = fig.add_subplot(grid[y + 1 : y + h, x : x + w])
            draw_stat(ax, panel, series)
        elif panel["type"] == "bargauge":
            ax = fig.add_subplot(grid[y + 1 : y + h - 1, x : x + w])
            draw_bargauge(ax, panel, series)
        else:
            ax = fig.add_subplot(grid[y + 1 : y + h - LEGEND_ROWS, x : x + w])
            draw_timeseries(ax, panel, series, window)
        ax.set_title(panel["title"], fontsize=9, loc="left")
    start, end, _ = window
    span = " - ".join(
        dt.datetime.fromtimestamp(t, dt.UTC).strftime("%H:%M:%S") for t in (start, end)
    )
    fig.suptitle(f"{dashboard['title']}   ({span} UTC; {shown})", fontsize=14, y=0.995)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=15.0, help="the window ending at --end")
    p.add_argument("--start", type=float, help="unix time (default: --end minus --minutes)")
    p.add_argument("--end", type=float, help="unix time (default: now)")
    p.add_argument("--step", type=float, help="seconds between points (default: window/240)")
    p.add_argument("--scrape-interval", type=float, default=15.0, help="seconds")
    p.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a template variable's value (repeatable; default: every value)",
    )
    p.add_argument("--require-data", action="store_true", help="exit 1 if a panel is empty")
    args = p.parse_args(argv)

    end = args.end if args.end is not None else time.time()
    start = args.start if args.start is not None else end - args.minutes * 60
    step = args.step or max(1.0, (end - start) / 240)
    dashboard = json.loads(args.dashboard.read_text())
    variables = {v["name"]: ".+" for v in dashboard["templating"]["list"] if v["type"] == "query"}
    for item in args.var:
        name, _, value = item.partition("=")
        variables[name] = regex_value(value.split(","))
    builtins = {
        # Grafana: at least four scrapes, and at least one step plus one scrape.
        "__rate_interval": duration(max(4 * args.scrape_interval, step + args.scrape_interval)),
        "__interval": duration(step),
        "__range": duration(end - start),
    }
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            target["expr"] = expand(target["expr"], variables, builtins)

    shown = ", ".join(args.var) or "every gateway"
    base = args.prometheus.rstrip("/")
    counts = render(dashboard, base, variables, (start, end, step), args.out, shown=shown)
    for title, n in counts:
        print(f"{title}: {n} series")
    empty = [title for title, n in counts if n == 0]
    print(f"wrote {args.out} ({len(counts)} panels, {len(empty)} without data)")
    return 1 if args.require_data and empty else 0


if __name__ == "__main__":
    sys.exit(main())
