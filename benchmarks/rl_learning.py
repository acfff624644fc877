"""GRPO's learning run and its control (docs/rl.md, "The learning run"): does reinforcement learning on the
arithmetic task raise the held-out reward, and does it need the rewards to do so?

    python benchmarks/rl_learning.py [--runs-folder outputs/rl_learning]
        [--output-folder benchmarks/results/rl_learning]

Four stages, each one process and each skipped when its outputs already exist in --runs-folder:
1. sft: train_configs/sft_arithmetic_debug.toml (the debug model from random weights, 600 steps). GRPO starts
   from its step-200 checkpoint, stopped early so that there is room to learn.
2. grpo: train_configs/grpo_debug.toml from that checkpoint (800 steps, exact-answer reward).
3. control: the same run with --rl.shuffle_rewards: each step's rewards are permuted across its completions
   before the advantages, so the updates keep their size and the run its steps, seed and prompts, but the reward
   no longer says which answer was right.
4. eval: scripts/rl_eval.py on the 200 held-out problems, 8 samples each at temperature 1 (the mean reward is the
   share of right answers; pass@8), for the start, every saved checkpoint of both runs, and the end of the SFT run.

Writes to --output-folder: the three runs' metrics.jsonl, evaluations.json (every rl_eval figure), summary.md
(the table docs/rl.md quotes) and, when matplotlib is installed (`pip install -e ".[plot]"`), curve.png.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

from report import environment

SFT_CONFIG = "train_configs/sft_arithmetic_debug.toml"
GRPO_CONFIG = "train_configs/grpo_debug.toml"
START_STEP = 200  # the SFT checkpoint GRPO starts from
# The bar: GRPO gains at least this much held-out reward, the control less than a third of GRPO's gain.
REQUIRED_GAIN = 0.15


def rows_of(folder: pathlib.Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def last_step(config: str) -> int:
    from torchtitan.config import load_config

    cfg, _ = load_config(["--job.config_file", config])
    return cfg.training.steps


def train(folder: pathlib.Path, options: list[str]) -> list[dict]:
    """Run the trainer into ``folder`` unless its final checkpoint is there; a run stopped part way resumes from its
    last checkpoint (the trainer's own resume: the same steps as a straight run)."""
    steps = last_step(options[options.index("--job.config_file") + 1])
    if not (folder / "checkpoint" / f"step-{steps}").is_dir():
        command = [sys.executable, "-m", "torchtitan.train", *options, "--job.dump_folder", str(folder)]
        print(f"# {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return rows_of(folder)


def evaluate(checkpoint: pathlib.Path, cache: pathlib.Path) -> dict:
    """scripts/rl_eval.py's figures for one checkpoint, kept in ``cache``."""
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "scripts/rl_eval.py", "--config", GRPO_CONFIG, "--checkpoint", str(checkpoint),
                   "--samples", "8", "--temperature", "1", "--json", str(cache)]
        print(f"# {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(cache.read_text())


def checkpoints(folder: pathlib.Path) -> dict[int, pathlib.Path]:
    found = {}
    for path in (folder / "checkpoint").glob("step-*"):
        if path.name.removeprefix("step-").isdigit():
            found[int(path.name.removeprefix("step-"))] = path
    return dict(sorted(found.items()))


def minutes(rows: list[dict]) -> float:
    return max(r["elapsed_s"] for r in rows if "elapsed_s" in r) / 60


def window_mean(rows: list[dict], key: str, end: int, width: int = 50) -> float:
    values = [r[key] for r in rows if key in r and end - width < r["step"] <= end]
    return sum(values) / len(values)


def plot(curves: dict[str, tuple[list[int], list[float]]], train: dict[str, list[dict]], path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (held_out, training) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, (steps, values) in curves.items():
        held_out.plot(steps, values, marker="o", label=name)
    held_out.set(title="held-out mean reward (200 prompts x 8, T=1)", xlabel="GRPO step", ylabel="reward")
    for name, rows in train.items():
        steps = [r["step"] for r in rows if r["step"] >= 25]
        training.plot(steps, [window_mean(rows, "rl/reward_mean", s) for s in steps], label=name)
    training.set(title="training reward (50-step mean)", xlabel="GRPO step")
    for axes in (held_out, training):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-folder", default="outputs/rl_learning")
    parser.add_argument("--output-folder", default="benchmarks/results/rl_learning")
    args = parser.parse_args()
    runs, out = pathlib.Path(args.runs_folder), pathlib.Path(args.output_folder)
    out.mkdir(parents=True, exist_ok=True)

    sft_rows = train(runs / "sft", ["--job.config_file", SFT_CONFIG])
    start = runs / "sft" / "checkpoint" / f"step-{START_STEP}"
    grpo = ["--job.config_file", GRPO_CONFIG, "--checkpoint.initial_load_path", str(start)]
    rows = {"GRPO": train(runs / "grpo", grpo),
            "control (shuffled rewards)": train(runs / "control", [*grpo, "--rl.shuffle_rewards"])}
    folders = {"GRPO": runs / "grpo", "control (shuffled rewards)": runs / "control"}

    start_figures = evaluate(start, runs / "eval" / "start.json")
    sft_end = max(checkpoints(runs / "sft"))
    sft_end_figures = evaluate(checkpoints(runs / "sft")[sft_end], runs / "eval" / f"sft-{sft_end}.json")
    evaluations = {"start": start_figures, f"sft-{sft_end}": sft_end_figures}
    curves = {}
    for name, folder in folders.items():
        steps, values = [0], [start_figures["reward_mean"]]
        for step, path in checkpoints(folder).items():
            figures = evaluate(path, runs / "eval" / f"{folder.name}-{step}.json")
            evaluations[f"{folder.name}-{step}"] = figures
            steps.append(step)
            values.append(figures["reward_mean"])
        curves[name] = (steps, values)

    for name, folder in [("sft", runs / "sft"), *[(f.name, f) for f in folders.values()]]:
        shutil.copyfile(folder / "metrics.jsonl", out / f"{name}_metrics.jsonl")
    (out / "evaluations.json").write_text(json.dumps(evaluations, indent=1) + "\n")

    gains = {name: values[-1] - values[0] for name, (_, values) in curves.items()}
    gain, control_gain = gains["GRPO"], gains["control (shuffled rewards)"]
    passed = gain >= REQUIRED_GAIN and control_gain < gain / 3
    lines = ["# GRPO learning run on the arithmetic task\n", f"{environment()}\n",
             "Held-out mean reward = share of right answers over 200 held-out problems x 8 samples at temperature 1 "
             "(scripts/rl_eval.py); training reward = the mean over the step's 64 completions, averaged over the 50 "
             "steps up to the checkpoint. The start is the SFT run's step-"
             f"{START_STEP} checkpoint (held-out reward {start_figures['reward_mean']:.3f}, pass@8 "
             f"{start_figures['pass@8']:.3f}); the finished SFT run (step {sft_end}) scores "
             f"{sft_end_figures['reward_mean']:.3f} held out.\n",
             "| step | GRPO held-out | GRPO pass@8 | GRPO training | control held-out | control pass@8 | "
             "control training |", "|---:|---:|---:|---:|---:|---:|---:|",
             f"| 0 | {start_figures['reward_mean']:.3f} | {start_figures['pass@8']:.3f} | "
             f"{rows['GRPO'][0]['rl/reward_mean']:.3f} (step 1) | {start_figures['reward_mean']:.3f} | "
             f"{start_figures['pass@8']:.3f} | "
             f"{rows['control (shuffled rewards)'][0]['rl/reward_mean']:.3f} (step 1) |"]
    for step in curves["GRPO"][0][1:]:
        cells = []
        for folder in folders.values():
            figures = evaluations[f"{folder.name}-{step}"]
            cells += [f"{figures['reward_mean']:.3f}", f"{figures['pass@8']:.3f}",
                      f"{window_mean(rows_of(folder), 'rl/reward_mean', step):.3f}"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", f"GRPO gain {gain:+.3f}, control gain {control_gain:+.3f} (bar: GRPO >= {REQUIRED_GAIN}, control "
              f"< a third of GRPO's = {gain / 3:.3f}): {'met' if passed else 'NOT met'}.",
              *[f"{name}: {minutes(r):.1f} minutes for {r[-1]['step']} steps (the trainer's elapsed time, start-up "
                f"left out)" for name, r in [("SFT", sft_rows), *rows.items()]]]
    if plot(curves, rows, out / "curve.png"):
        lines.append("\n![held-out and training reward](curve.png)")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
