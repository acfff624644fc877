"""The vision-language learning run and its control (docs/vision.md, "The learning run"): does the Qwen3-VL debug
model learn to answer questions about the shapes pictures from the pixels?

    python benchmarks/vlm_learning.py [--runs-folder outputs/vlm_learning]
        [--output-folder benchmarks/results/vlm_learning]

Three stages, each one process and each skipped when its outputs already exist in --runs-folder:
1. images: train_configs/vlm_debug.toml as shipped (random weights, 600 steps on "shapes", validation on held-out
   pictures every 100 steps).
2. blank: the same run on "shapes_blank": the same questions and answers, the pictures left empty. Whatever this
   run answers right, it answers from the question alone.
3. eval: each run's last checkpoint answers, by greedy generation through the engine, the first 100 held-out
   questions of each kind (colour, shape, count, position, caption) about pictures it never saw (the blank run
   about blank ones); an answer is right when it is exactly the expected text.

Writes to --output-folder: both runs' metrics.jsonl, evaluations.json (every answer) and summary.md (the table
docs/vision.md quotes).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

from report import environment

CONFIG = "train_configs/vlm_debug.toml"
QUESTIONS_PER_KIND = 100
# The issue's bars: right answers of the pictures' run, by kind.
REQUIRED = {"colour": 0.80, "shape": 0.50, "count": 0.40}


def rows_of(folder: pathlib.Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def last_step() -> int:
    from torchtitan.config import load_config

    cfg, _ = load_config(["--job.config_file", CONFIG])
    return cfg.training.steps


def train(folder: pathlib.Path, options: list[str]) -> None:
    """Run the trainer into ``folder`` unless its final checkpoint is there (a run stopped part way resumes from its
    last checkpoint)."""
    if (folder / "checkpoint" / f"step-{last_step()}").is_dir():
        return
    command = [sys.executable, "-m", "torchtitan.train", "--job.config_file", CONFIG, *options,
               "--job.dump_folder", str(folder)]
    print(f"# {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def answers(checkpoint: pathlib.Path, blank: bool) -> list[dict]:
    """The checkpoint's greedy answers to the first QUESTIONS_PER_KIND held-out questions of each kind."""
    from torchtitan.config_check import load_model_config
    from torchtitan.data.chat_template import ChatTemplate
    from torchtitan.data.shapes import KINDS, shapes_sample
    from torchtitan.generation import GenerationEngine, SamplingConfig
    from torchtitan.inference import load_model
    from torchtitan.models.shared.vision_language import image_chat
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = load_model_config(CONFIG, ())
    tokenizer = get_train_spec(cfg.model.name).build_tokenizer_fn(cfg.model.hf_assets_path)
    model = load_model(CONFIG, str(checkpoint), device="cpu")
    reader = image_chat(model.args, cfg.training.chat)
    template = ChatTemplate(tokenizer.chat_template)
    samples = [shapes_sample(i, split="validation", blank=blank) for i in range(QUESTIONS_PER_KIND * len(KINDS))]
    prompts = [reader.prompt(tokenizer, template, s.messages()[:1], [s.image], cfg.training.seq_len) for s in samples]
    engine = GenerationEngine(model)
    done = engine.generate([ids for ids, _ in prompts], SamplingConfig(max_new_tokens=8, temperature=0),
                           stop_token_ids=[tokenizer.eos_id], images=[shown for _, shown in prompts],
                           decode=lambda ids: tokenizer.decode([t for t in ids if t != tokenizer.eos_id]))
    return [{"kind": s.kind, "question": s.question, "expected": s.answer, "answer": c.text.strip(),
             "right": c.text.strip() == s.answer} for s, c in zip(samples, done)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-folder", default="outputs/vlm_learning")
    parser.add_argument("--output-folder", default="benchmarks/results/vlm_learning")
    args = parser.parse_args()
    runs, out = pathlib.Path(args.runs_folder), pathlib.Path(args.output_folder)
    out.mkdir(parents=True, exist_ok=True)
    train(runs / "images", [])
    train(runs / "blank", ["--training.dataset", "shapes_blank", "--validation.dataset", "shapes_blank"])
    step = last_step()
    evaluations = {}
    for name in ("images", "blank"):
        shutil.copy(runs / name / "metrics.jsonl", out / f"{name}_metrics.jsonl")
        evaluations[name] = answers(runs / name / "checkpoint" / f"step-{step}", blank=name == "blank")
    (out / "evaluations.json").write_text(json.dumps(evaluations, indent=1))

    from torchtitan.data.shapes import KINDS, OPTIONS

    def share(name: str, kind: str) -> float:
        rows = [r for r in evaluations[name] if r["kind"] == kind]
        return sum(r["right"] for r in rows) / len(rows)

    lines = [f"# Vision-language learning run ({CONFIG}, {step} steps)", "", environment(), "",
             f"Greedy answers to the first {QUESTIONS_PER_KIND} held-out questions of each kind (exact match).", "",
             "| kind | chance | pictures | blank pictures | bar (pictures) |", "|---|---:|---:|---:|---:|"]
    for kind in KINDS:
        chance = f"{1 / len(OPTIONS[kind]):.1%}" if kind in OPTIONS else "-"
        bar = f"{REQUIRED[kind]:.0%}" if kind in REQUIRED else "-"
        lines.append(f"| {kind} | {chance} | {share('images', kind):.0%} | {share('blank', kind):.0%} | {bar} |")
    val = {name: [r for r in rows_of(runs / name) if "val_loss" in r] for name in ("images", "blank")}
    lines += ["", "| held-out loss (answers only) | " + " | ".join(f"step {r['step']}" for r in val["images"]) + " |",
              "|---|" + "---:|" * len(val["images"])]
    for name in ("images", "blank"):
        lines.append(f"| {name} | " + " | ".join(f"{r['val_loss']:.3f}" for r in val[name]) + " |")
    # The trainer's own clock at the last step (elapsed_s: training, validation and checkpoints since it started).
    elapsed = {name: max(r["elapsed_s"] for r in rows_of(runs / name) if "elapsed_s" in r) for name in val}
    lines += ["", "Training time, by the trainer's clock: " + ", ".join(
        f"{name} {seconds / 60:.1f} min" for name, seconds in elapsed.items())]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    failed = [kind for kind, bar in REQUIRED.items() if share("images", kind) < bar]
    off_chance = [kind for kind in REQUIRED if abs(share("blank", kind) - 1 / len(OPTIONS[kind])) > 0.10]
    if failed or off_chance:
        print(f"below the bar: {failed}; blank run more than 10 points from chance: {off_chance}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
