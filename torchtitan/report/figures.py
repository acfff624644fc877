"""The report's plots, drawn with matplotlib's Agg backend into PNG bytes (no display, no browser).

Each plot is made from its data, ``{"x": steps, "series": {name: values aligned with x, None where a step has
none}}`` plus a few plot-specific keys; the same data is embedded in the HTML page beside the picture, so a reader
(or a test) can check what was drawn. A plot whose data the run does not have is left out, with a note saying
what is missing.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.components.observability.lag import lag_behind, phase_end_lags
from torchtitan.report.run_folder import Run

# Written into every PNG's metadata (the "Software" text chunk): how the script knows a PNG it may replace.
PNG_SOFTWARE = "torchtitan scripts/report.py"
# Heatmaps and the phase breakdown draw at most this many steps (evenly spaced, first and last kept), and a heatmap
# at most about this many cells (a model of 58 x 256 experts gets fewer steps): the page embeds every value drawn.
MAX_COLUMNS = 400
MAX_CELLS = 250_000
# Per-layer lines of the MoE balance up to this many layers; beyond, the busiest layer's and the mean.
MAX_LAYER_LINES = 8
# Memory per rank is drawn as one line per rank up to this many ranks; beyond, the min/max over ranks only.
MAX_RANK_LINES = 16
# The timeline's phases in step order (others a run records follow, by name).
PHASES = ("data", "forward_backward", "grad_comm", "optimizer", "logging", "evaluation", "checkpoint")


@dataclass
class Plot:
    name: str  # the PNG's file name stem and the page's data-plot attribute
    title: str
    caption: str
    data: dict
    png: bytes


@dataclass
class _Draft:
    name: str
    title: str
    caption: str
    data: dict
    draw: Callable  # (figure, data) -> None


def make_plots(run: Run) -> tuple[list[Plot], list[str]]:
    """The plots the run's data allows, in page order, and a note for each plot (or part) left out."""
    notes: list[str] = []
    plots = []
    for builder in _BUILDERS:
        try:
            draft = builder(run, notes)
            if isinstance(draft, str):
                notes.append(draft)
                continue
            plots.append(Plot(draft.name, draft.title, draft.caption, draft.data, _png(draft)))
        except Exception as e:  # a plot that fails must not cost the others (and the reader its warnings)
            notes.append(f"{builder.__name__.strip('_')}: could not be drawn ({type(e).__name__}: {e}; a bug, "
                         "please report it)")
    return plots, notes


def _png(draft: _Draft) -> bytes:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.8), dpi=100, layout="constrained")
    draft.draw(figure, draft.data)
    figure.suptitle(draft.title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": PNG_SOFTWARE})
    return buffer.getvalue()


# ----- data -----


def _value(value):
    """A number for the page's JSON (which has no NaN or infinity: those become null, a gap in the line)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _column(rows: list[dict], key: str) -> dict[int, object]:
    return {row["step"]: _value(row[key]) for row in rows if key in row and not isinstance(row[key], (list, dict))}


def _aligned(columns: dict[str, dict[int, object]]) -> dict:
    """{"x": every step any column has, "series": each column with a value at some step, aligned with x}."""
    columns = {name: c for name, c in columns.items() if any(v is not None for v in c.values())}
    x = sorted({step for column in columns.values() for step in column})
    return {"x": x, "series": {name: [column.get(step) for step in x] for name, column in columns.items()}}


def _thin(data: dict, limit: int = MAX_COLUMNS) -> dict:
    """``data`` cut to at most ``limit`` steps (fewer when its rows times the steps pass MAX_CELLS), evenly spaced
    (first and last kept); "steps_in_run" says how many there were."""
    n = len(data["x"])
    limit = max(10, min(limit, MAX_CELLS // max(1, len(data["series"]))))
    if n <= limit:
        return data
    keep = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})
    return {**data, "x": [data["x"][i] for i in keep], "steps_in_run": n,
            "series": {name: [values[i] for i in keep] for name, values in data["series"].items()}}


def _thinned_note(data: dict) -> str:
    return (f" {len(data['x'])} of the run's {data['steps_in_run']} steps are drawn, evenly spaced."
            if "steps_in_run" in data else "")


# ----- drawing -----


def _lines(ax, data: dict, names: list[str] | None = None, **style) -> None:
    x = data["x"]
    for name in names if names is not None else list(data["series"]):
        points = [(s, v) for s, v in zip(x, data["series"][name]) if v is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="." if len(points) <= 60 else None, label=name, **style)


def _finish(ax, ylabel: str, legend: bool = True) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        _legend(ax, ax.get_legend_handles_labels()[0])


def _legend(ax, handles: list) -> None:
    """Beside the plot, not over its lines; none for a single line (the title names it)."""
    if len(handles) > 1:
        ax.figure.legend(handles, [h.get_label() for h in handles], fontsize="small", loc="outside right upper")


def _line_plot(ylabel: str, log: bool = False) -> Callable:
    def draw(figure, data):
        ax = figure.add_subplot()
        _lines(ax, data)
        if log and all(v is None or v > 0 for values in data["series"].values() for v in values):
            ax.set_yscale("log")
        _finish(ax, ylabel)
    return draw


def _heatmap(figure, data: dict, ylabel: str, colorbar: str, row_labels: list[str], groups: list[tuple[int, str]]
             = ()) -> None:
    """Rows are the series, columns the steps of x; an empty cell (no value) is left blank. ``groups``: (first
    row, label) of row groups, separated by lines and labelled instead of every row when there are many."""
    import numpy as np

    ax = figure.add_subplot()
    matrix = np.array([[np.nan if v is None else v for v in values] for values in data["series"].values()],
                      dtype=float)
    image = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", interpolation="nearest", cmap="viridis")
    figure.colorbar(image, ax=ax, label=colorbar)
    steps = data["x"]
    ticks = sorted({round(i * (len(steps) - 1) / 7) for i in range(8)}) if len(steps) > 8 else range(len(steps))
    ax.set_xticks(list(ticks), [str(steps[i]) for i in ticks])
    if len(row_labels) <= 16:
        ax.set_yticks(range(len(row_labels)), row_labels, fontsize="small" if len(row_labels) > 12 else None)
    elif groups:
        shown = groups[:: -(-len(groups) // 16)]  # at most 16 group labels
        ax.set_yticks([first for first, _ in shown], [label for _, label in shown], fontsize="small")
    else:
        rows = sorted({round(i * (len(row_labels) - 1) / 7) for i in range(8)})
        ax.set_yticks(rows, [row_labels[i] for i in rows])
    for first, _ in groups[1:] if 1 < len(groups) <= 16 else ():  # more lines would hide the rows
        ax.axhline(first - 0.5, color="white", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)


# ----- the plots -----


def _loss(run: Run, notes: list[str]) -> _Draft | str:
    data = _aligned({"loss": _column(run.training, "loss"), "val_loss": _column(run.validation, "val_loss")})
    if not data["series"]:
        return "loss: no training or validation rows with a loss"
    if "val_loss" not in data["series"]:
        notes.append("validation loss: no val_loss rows (validation.enable is off, or no validation step came)")
    return _Draft("loss", "Loss", "Training loss at each log step and validation loss (val_loss) where validated.",
                  data, _line_plot("loss"))


def _single(key: str, name: str, title: str, ylabel: str, caption: str, log: bool = False) -> Callable:
    def build(run: Run, notes: list[str]) -> _Draft | str:
        data = _aligned({key: _column(run.training, key)})
        if not data["series"]:
            return f"{title.lower()}: no {key} in the training rows"
        return _Draft(name, title, caption, data, _line_plot(ylabel, log))
    build.__name__ = name
    return build


_learning_rate = _single("lr", "learning_rate", "Learning rate", "lr", "The learning rate of each log step.")
_grad_norm = _single("grad_norm", "grad_norm", "Gradient norm", "norm",
                     "The gradient's global norm before clipping, at each log step.")


def _throughput(run: Run, notes: list[str]) -> _Draft | str:
    data = _aligned({"tps": _column(run.training, "tps"), "mfu": _column(run.training, "mfu")})
    if "tps" not in data["series"]:
        return "throughput: no tps in the training rows"
    if "mfu" not in data["series"]:
        notes.append("MFU: not known for this run (no peak FLOP/s for its device; metrics.peak_tflops sets one)")

    def draw(figure, data):
        ax = figure.add_subplot()
        _lines(ax, data, ["tps"], color="tab:blue")
        _finish(ax, "tokens/s per rank", legend=False)
        if "mfu" in data["series"]:
            right = ax.twinx()
            _lines(right, data, ["mfu"], color="tab:orange")
            right.set_ylabel("MFU (%)")
            _legend(ax, [h for a in (ax, right) for h in a.get_legend_handles_labels()[0]])
    return _Draft("throughput", "Throughput", "Tokens per second per rank (left) and model FLOP utilisation "
                                              "(right), each averaged since the previous log step.", data, draw)


def _step_time(run: Run, notes: list[str]) -> _Draft | str:
    keys = ["step_time_s", "data_time_s", "phase/total/min", "phase/total/median", "phase/total/max"]
    data = _aligned({key: _column(run.training, key) for key in keys})
    if not data["series"]:
        return "step time: no step_time_s in the training rows"
    return _Draft("step_time", "Step time", "Seconds per step and waiting for data (rank 0's mean since the last "
                                            "log step); phase/total: the fastest, median and slowest rank's.",
                  data, _line_plot("seconds"))


_MEMORY_STAT = re.compile(r"memory/(.+)/(min|median|max)")
_PEAK_KINDS = ("peak_reserved_gib", "peak_rss_gib", "peak_allocated_gib")


def _memory(run: Run, notes: list[str]) -> _Draft | str:
    keys = sorted({key for row in run.training for key in row if _MEMORY_STAT.fullmatch(key)})
    columns = {key: _column(run.training, key) for key in keys or ["memory_gib"]}
    ranks = {rank: [row for row in rows if isinstance(row.get("memory"), dict)] for rank, rows in run.timeline.items()}
    ranks = {rank: rows for rank, rows in ranks.items() if rows}
    if len(ranks) > MAX_RANK_LINES:
        notes.append(f"memory per rank: {len(ranks)} ranks are too many lines; the min and max over ranks are drawn")
    elif ranks:
        kinds = sorted({kind for rows in ranks.values() for row in rows for kind in row["memory"]})
        kind = next((k for k in _PEAK_KINDS if k in kinds), kinds[0] if kinds else None)
        for rank, rows in sorted(ranks.items()):
            columns[f"rank{rank}/{kind}"] = {row["step"]: _value(row["memory"].get(kind)) for row in rows}
    data = _aligned(columns)
    plan = run.plan["memory_gib"]["total"] if run.plan else None
    if plan is None:
        plans = _column(run.training, "memory/plan_gib")
        plan = next((v for _, v in sorted(plans.items(), reverse=True) if v is not None), None)
    if plan is None:
        notes.append("memory plan: no timeline/plan.json or memory/plan_gib (the planner could not plan the run, "
                     "or it predates them)")
    if not data["series"]:
        return "memory: no memory values in the training rows or timelines"
    data["plan_gib"] = plan

    def draw(figure, data):
        ax = figure.add_subplot()
        _lines(ax, data)
        if data["plan_gib"] is not None:
            ax.axhline(data["plan_gib"], color="black", linestyle="--", label=f"plan {data['plan_gib']:.3g} GiB")
        _finish(ax, "GiB")
    return _Draft("memory", "Memory against the plan", "Memory in GiB per log step: over ranks (memory/KIND/min, "
                  "median, max) or rank 0's peak (memory_gib), each rank's peak from its timeline, and the planner's "
                  "prediction for this config (dashed).", data, draw)


def _median_rank(values: dict[int, float]) -> int:
    """The rank whose value is the median (the lower of the middle two for an even count; ties by rank)."""
    ordered = sorted(values, key=lambda rank: (values[rank], rank))
    return ordered[(len(ordered) - 1) // 2]


_NO_TIMELINE = "no timeline/rank*.jsonl (observability.record_phases is off, or the run predates it)"


def _by_step(run: Run) -> dict[int, dict[int, dict]]:
    """{step: {rank: its timeline row}}."""
    by_step: dict[int, dict[int, dict]] = {}
    for rank, rows in run.timeline.items():
        for row in rows:
            by_step.setdefault(row["step"], {})[rank] = row
    return dict(sorted(by_step.items()))


def _phase_names(rows) -> list[str]:
    names = {name for row in rows if isinstance(row.get("phases"), dict) for name in row["phases"]}
    return [n for n in PHASES if n in names] + sorted(names - set(PHASES))


def _lags(rows: dict[int, dict]) -> dict[int, float]:
    """{rank: its lag behind the median rank} at one step (as straggler detection measures it), over the ranks
    whose row has its start and every phase a number."""
    rows = {rank: row for rank, row in rows.items() if isinstance(row.get("start"), (int, float)) and
            isinstance(phases := row.get("phases"), dict) and all(isinstance(v, (int, float)) for v in phases.values())}
    names = _phase_names(rows.values())
    ranks = sorted(rows)
    lags = phase_end_lags([rows[rank]["start"] for rank in ranks],
                          [[rows[rank]["phases"].get(name, 0.0) for name in names] for rank in ranks])
    return {rank: lag_behind(row) for rank, row in zip(ranks, lags)}


def _rank_lag(run: Run, notes: list[str]) -> _Draft | str:
    if not run.timeline:
        return f"per-rank lag: {_NO_TIMELINE}"
    if len(run.timeline) == 1:
        return "per-rank lag: one rank's timeline; no other rank to be behind"
    columns: dict[str, dict[int, object]] = {f"rank{rank}": {} for rank in sorted(run.timeline)}
    left_out = 0
    for step, rows in _by_step(run).items():
        # The median of a step some rank lacks would be another median, and a lag behind it another lag.
        lags = _lags(rows) if len(rows) == len(run.timeline) else {}
        if len(lags) < len(run.timeline):
            left_out += 1
            continue
        for rank, lag in lags.items():
            columns[f"rank{rank}"][step] = _value(lag)
    data = _aligned(columns)
    if not data["series"]:
        return "per-rank lag: no step that every rank's timeline has with its start and phases"
    data = _thin({**data, "steps_left_out": left_out})
    labels = list(data["series"])
    missing = (f" {left_out} step{'s' if left_out != 1 else ''} that some rank's timeline lacks (or has without its "
               "start and phases) left out." if left_out else "")

    def draw(figure, data):
        _heatmap(figure, data, "rank", "seconds behind the median rank", [label.removeprefix("rank") for label in
                                                                          labels])
    return _Draft("rank_lag", "Lag behind the median rank", "How far each rank is behind the median rank "
                  "(seconds) at each step: the most it reached a phase's end after the median rank (of an even count "
                  "the lower middle one, the one ahead), from the step starts and phases in timeline/rank*.jsonl, as "
                  "straggler detection measures it; a straggler is a bright row. Not the ranks' step times: they "
                  "wait for each other in the collectives, so every rank's step lasts as long as the slowest one's "
                  "(the Step time plot has it)." + missing + _thinned_note(data), data, draw)


def _phases(run: Run, notes: list[str]) -> _Draft | str:
    if not run.timeline:
        return f"phase breakdown: {_NO_TIMELINE}"
    by_step = _by_step(run)
    steps = list(by_step)
    # By lag, not by step time (the same on every rank of a synchronous step): a rank a straggler makes wait.
    chosen = [rows[_median_rank(_lags(rows) or dict.fromkeys(rows, 0.0))] for rows in by_step.values()]
    names = _phase_names(chosen)
    if not names:
        return "phase breakdown: the timeline rows have no phases"
    data = _thin({"x": steps, "rank": [row.get("rank") for row in chosen],
                  "series": {name: [_value((row.get("phases") or {}).get(name)) for row in chosen] for name in names}})

    def draw(figure, data):
        ax = figure.add_subplot()
        stacks = [[0.0 if v is None else v for v in values] for values in data["series"].values()]
        ax.stackplot(data["x"], stacks, labels=list(data["series"]))
        _finish(ax, "seconds")
    return _Draft("phases", "Where the median rank's step went", "The phases, stacked, of the rank whose lag (as in "
                  "Lag behind the median rank) is the median at each step (of an even count the lower middle one): a "
                  "typical rank, not a straggler, so a straggler shows here as the time this rank waits for it, in "
                  "the phase whose collective waits." + _thinned_note(data), data, draw)


_LAYER_KEY = re.compile(r"moe/layer(\d+)/(max_tokens|mean_tokens|expert_fractions)")


def _moe_layers(run: Run, stat: str) -> list[int]:
    return sorted({int(m.group(1)) for row in run.training for key in row
                   if (m := _LAYER_KEY.fullmatch(key)) and m.group(2) == stat})


def _moe_balance(run: Run, notes: list[str]) -> _Draft | str:
    layers = {}
    for layer in _moe_layers(run, "max_tokens"):
        busiest, mean = (_column(run.training, f"moe/layer{layer}/{s}") for s in ("max_tokens", "mean_tokens"))
        layers[f"layer{layer}"] = {step: busiest[step] / mean[step] for step in busiest
                                   if busiest[step] is not None and mean.get(step)}
    if len(layers) > MAX_LAYER_LINES:
        steps = sorted({step for column in layers.values() for step in column})
        layers = {"busiest layer": {step: max(c[step] for c in layers.values() if step in c) for step in steps}}
        caption = "over the MoE layers: the mean (max_over_mean) and the busiest layer's"
    else:
        caption = "per MoE layer and averaged over the layers (max_over_mean)"
    data = _aligned({"max_over_mean": _column(run.training, "moe/max_over_mean"), **layers})
    if not data["series"]:
        return "MoE balance: no moe/ keys in the training rows (a dense model)"
    return _Draft("moe_balance", "MoE expert balance", f"The busiest expert's tokens over the mean, {caption}; 1 is "
                  "perfect balance.", data, _line_plot("busiest / mean"))


def _expert_load(run: Run, notes: list[str]) -> _Draft | str:
    layers = _moe_layers(run, "expert_fractions")
    if not layers:
        return "MoE expert load: no moe/layer*/expert_fractions in the training rows (a dense model, or a run from " \
               "before they were logged)"
    columns, groups = {}, []
    for layer in layers:
        groups.append((len(columns), f"layer {layer}"))
        shares = {row["step"]: row[key] for row in run.training
                  if isinstance(row.get(key := f"moe/layer{layer}/expert_fractions"), list)}
        for expert in range(max(map(len, shares.values()))):
            columns[f"layer{layer}/expert{expert}"] = {step: _value(s[expert]) if expert < len(s) else None
                                                       for step, s in shares.items()}
    data = _thin(_aligned(columns))
    labels = [name.replace("layer", "L").replace("/expert", " E") for name in data["series"]]

    def draw(figure, data):
        _heatmap(figure, data, "layer, expert", "share of the layer's routed tokens", labels, groups)
    return _Draft("expert_load", "MoE expert load", "Each expert's share of its layer's routed tokens at each log "
                  "step (1/experts is an even share)." + _thinned_note(data), data, draw)


def _evaluation(run: Run, notes: list[str]) -> _Draft | str:
    keys = sorted({key for row in run.evaluation for key in row if key.startswith("eval/")})
    data = _aligned({key.removeprefix("eval/"): _column(run.evaluation, key) for key in keys})
    if not data["series"]:
        return "evaluation scores: no eval/* rows ([eval] is off)"
    return _Draft("evaluation", "Evaluation scores", "Downstream task scores (eval/TASK/METRIC rows) at each "
                  "evaluation step.", data, _line_plot("score"))


def _rl_rewards(run: Run, notes: list[str]) -> _Draft | str:
    keys = ["rl/reward_mean", "rl/reward_std"] + sorted({key for row in run.training for key in row
                                                         if key.startswith("rl/reward/")})
    data = _aligned({key.removeprefix("rl/"): _column(run.training, key) for key in keys})
    if "reward_mean" not in data["series"]:
        return "RL rewards: no rl/reward_mean in the training rows (not a GRPO run)"

    def draw(figure, data):
        ax = figure.add_subplot()
        _lines(ax, data, [name for name in data["series"] if name != "reward_std"])
        if "reward_std" in data["series"]:
            band = [(s, m, d) for s, m, d in zip(data["x"], data["series"]["reward_mean"],
                                                 data["series"]["reward_std"]) if m is not None and d is not None]
            if band:
                xs, means, stds = zip(*band)
                ax.fill_between(xs, [m - d for m, d in zip(means, stds)], [m + d for m, d in zip(means, stds)],
                                alpha=0.2, label="reward_mean ± reward_std")
        _finish(ax, "reward")
    return _Draft("rl_rewards", "RL rewards", "The mean reward of each step's completions with its standard "
                  "deviation (band), and each reward function's mean (reward/NAME).", data, draw)


_BUILDERS = [_loss, _learning_rate, _grad_norm, _throughput, _step_time, _memory, _rank_lag, _phases,
             _moe_balance, _expert_load, _evaluation, _rl_rewards]
