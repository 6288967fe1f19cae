"""PNG charts of a `bench serve` result (matplotlib, Agg backend: no display needed).

Top row: what the system delivers (throughput) against what one user feels (per-request output speed) as concurrency
grows. Middle row: TTFT and time-to-first-answer CDFs per level (reasoning models separate the two). For multi-turn
workloads a bottom row shows TTFT, cache hit rate and output speed by turn index.
"""

from __future__ import annotations

from typing import Any


def _cdf(ax: Any, result: dict[str, Any], metric: str, title: str) -> None:
    for level in result["levels"]:
        values = sorted(r[metric] for r in result["requests"]
                        if r["concurrency"] == level["concurrency"] and r["error"] is None and r[metric] is not None)
        if values:
            ax.step([values[0], *values], [0.0] + [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=f"concurrency {level['concurrency']}")
    ax.set_title(title)
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no requests", ha="center", va="center", transform=ax.transAxes)


def _concurrency_axis(ax: Any, concurrency: list[int]) -> None:
    if len(concurrency) > 1 and max(concurrency) / max(min(concurrency), 1) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency)
    ax.set_xticklabels([str(c) for c in concurrency])
    ax.set_xlabel("concurrency")
    ax.grid(alpha=0.3)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    levels = result["levels"]
    concurrency = [level["concurrency"] for level in levels]
    multi_turn = any(level.get("per_turn") for level in levels)
    rows = 3 if multi_turn else 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.2 * rows))
    fig.suptitle(f"{result['server']['model']} - {result['workload']['name']} - "
                 f"{result['config']['output_tokens']} max output tokens", fontsize=11)

    ax = axes[0][0]
    ax.plot(concurrency, [level["output_throughput_tps"] or 0 for level in levels], "o-", label="output tokens/s")
    ax.set_ylabel("output tokens/s")
    twin = ax.twinx()
    twin.plot(concurrency, [level["request_throughput_rps"] or 0 for level in levels], "s--", color="tab:orange",
              label="requests/s")
    twin.set_ylabel("requests/s")
    ax.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)
    ax.set_title("system throughput")
    _concurrency_axis(ax, concurrency)
    ax.legend(handles=ax.get_lines() + twin.get_lines(), fontsize=8, loc="upper left")

    ax = axes[0][1]
    for level in levels:
        speeds = [r["output_speed_tps"] for r in result["requests"]
                  if r["concurrency"] == level["concurrency"] and r["output_speed_tps"] is not None]
        ax.scatter([level["concurrency"]] * len(speeds), speeds, s=10, alpha=0.35, color="tab:gray")
    ax.plot(concurrency, [level["metrics"]["output_speed_tps"]["p50"] or 0 for level in levels], "o-", label="P50")
    ax.plot(concurrency, [level["metrics"]["output_speed_tps"]["mean"] or 0 for level in levels], "^:", label="mean")
    ax.set_title("per-request output speed (tokens/s after the first token)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("tokens/s")
    _concurrency_axis(ax, concurrency)
    ax.legend(fontsize=8)

    _cdf(axes[1][0], result, "ttft_s", "time to first token (thinking included)")
    _cdf(axes[1][1], result, "ttfa_s", "time to first answer token")

    if multi_turn:
        ax, right = axes[2][0], axes[2][1]
        cache_axis = None
        for i, level in enumerate(levels):
            per_turn = level.get("per_turn") or []
            turns = [row["turn"] for row in per_turn]
            label, color = f"concurrency {level['concurrency']}", f"C{i}"
            ax.plot(turns, [row["ttft_s_p50"] for row in per_turn], "o-", ms=3, color=color, label=label)
            right.plot(turns, [row["output_speed_tps_p50"] for row in per_turn], "o-", ms=3, color=color,
                       label=f"speed, {label}")
            hits = [(row["turn"], row["cache_hit_rate"]) for row in per_turn if row["cache_hit_rate"] is not None]
            if hits:
                cache_axis = cache_axis or right.twinx()
                cache_axis.plot([t for t, _ in hits], [h for _, h in hits], "x--", ms=4, color=color,
                                label=f"cache hit, {label}")
        for axis in (ax, right):
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title("TTFT P50 by turn")
        ax.set_xlabel("turn index")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        right.set_title("output speed P50 (and prefix cache hit rate) by turn")
        right.set_xlabel("turn index")
        right.set_ylabel("tokens/s")
        right.grid(alpha=0.3)
        handles = right.get_lines()
        if cache_axis is not None:
            cache_axis.set_ylabel("prefix cache hit rate")
            cache_axis.set_ylim(0, 1.02)
            handles += cache_axis.get_lines()
        right.legend(handles=handles, fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
