"""The ``grpo-lab`` command line.

    grpo-lab demo [--steps N] [--json]        GRPO on the embedded task, accuracy before and after
    grpo-lab eval [--model PATH] [--json]     held-out figures of a model on the embedded task
    grpo-lab train RECIPE.yaml [--field V]    train from a YAML recipe (see grpo_lab.cli.recipes)
    grpo-lab doctor RECIPE.yaml|SCRIPT.py [--field V]   the doctor's probe of a run, without training it
    grpo-lab export NOTEBOOK -o train.py      turn a notebook's exported cells into a script
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _print_table(title: str, rows: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)


def _rounded(value):
    """Figures to 4 decimals (evaluation runs in float32; more digits are noise)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def cmd_eval(args: argparse.Namespace) -> int:
    from grpo_lab.core.models import load_causal_lm, load_tokenizer
    from grpo_lab.tasks import default_task

    task = default_task(eval_size=args.eval_size)
    model_path = args.model or task.model
    model = load_causal_lm(model_path)
    tokenizer = load_tokenizer(model_path)
    figures = {"model": model_path, **task.evaluate(model, tokenizer, k=args.k, seed=args.seed)}
    if args.json:
        print(json.dumps(_rounded(figures)), file=args.out)
    else:
        _print_table(f"held-out evaluation on the {task.name} task", figures)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from grpo_lab.session.session import GRPOSession
    from grpo_lab.tasks import default_task

    start = time.perf_counter()
    task = default_task(eval_size=args.eval_size)
    output_dir = Path(args.output_dir)
    steps = args.steps if args.steps is not None else task.config_overrides["max_steps"]
    config = task.config(max_steps=steps, output_dir=str(output_dir), seed=args.seed)
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          eval_dataset=task.eval_dataset)
    if not args.json:
        print(f"GRPO on the embedded {task.name} task with the shipped tiny model: {steps} steps, "
              f"held-out accuracy on {args.eval_size} problems before and after.")
    before = task.evaluate(session.model, session.tokenizer)
    if not args.json:
        _print_table("before GRPO", before)
    session.run(steps, progress=not args.json)
    after = task.evaluate(session.model, session.tokenizer)
    output_dir.mkdir(parents=True, exist_ok=True)
    session.model.save_pretrained(output_dir / "model")
    session.tokenizer.save_pretrained(output_dir / "model")
    session.history.to_csv(output_dir / "history.csv", index=False)
    curve = _write_reward_curve(session.history, output_dir / "reward_curve.html")
    result = {
        "steps": session.global_step,
        "greedy_accuracy_before": before["greedy_accuracy"],
        "greedy_accuracy_after": after["greedy_accuracy"],
        "improvement_points": round(100 * (after["greedy_accuracy"] - before["greedy_accuracy"]), 2),
        "before": before,
        "after": after,
        "seconds": round(time.perf_counter() - start, 1),
        "model_dir": str(output_dir / "model"),
        "reward_curve": str(curve),
        "history": str(output_dir / "history.csv"),
    }
    if args.json:
        print(json.dumps(_rounded(result)), file=args.out)
    else:
        _print_table("after GRPO", after)
        print(f"greedy accuracy {before['greedy_accuracy']:.1%} -> {after['greedy_accuracy']:.1%} in "
              f"{result['seconds']:.0f}s; model saved to {result['model_dir']}, reward curve in {curve}, "
              f"per-step metrics in {result['history']}")
    return 0


def _write_reward_curve(history, path):
    """An offline HTML plot (plotly.js embedded) of reward and accuracy per step."""
    import plotly.graph_objects as go

    figure = go.Figure()
    for column in ["reward"] + [c for c in history.columns if c.startswith("rewards/") and c.endswith("/mean")]:
        figure.add_scatter(x=history["step"], y=history[column], mode="lines", name=column)
    figure.update_layout(title="GRPO on the embedded addition task", xaxis_title="step", yaxis_title="reward")
    figure.write_html(path, include_plotlyjs=True)
    return path


def cmd_train(args: argparse.Namespace) -> int:
    from grpo_lab.state.checkpoint import check_complete
    from grpo_lab.cli.recipes import build_trainer

    if args.resume_from is not None:
        check_complete(args.resume_from)  # before the model loads
    overrides = args.overrides + (["--disable_tqdm", "true"] if args.json else [])
    trainer = build_trainer(args.recipe, overrides)
    trainer.train(resume_from_checkpoint=args.resume_from)
    last = trainer.session.last_metrics
    trainer.save_model()
    trainer.close()  # frees the model and ends the process group of an accelerate launch
    if args.json:
        print(json.dumps(last), file=args.out)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Build the run a recipe or a training script describes, run ``session.doctor()`` on it instead
    of training, and print the findings; exit status 1 where one is an error, 2 where the recipe or
    the script cannot run up to the probe."""
    from pathlib import Path

    target = Path(args.target)
    if target.suffix not in (".yaml", ".yml", ".py"):
        raise ValueError(f"{args.target!r} is neither a recipe (.yaml) nor a training script (.py).")
    if not target.is_file():
        raise FileNotFoundError(f"{args.target}: no such file.")
    findings = _script_findings(target, args.overrides) if target.suffix == ".py" else _recipe_findings(
        target, args.overrides)
    if args.json:
        print(json.dumps({"summary": findings.summary(), "findings": [f.to_dict() for f in findings]}, default=str),
              file=args.out)
    else:
        print(repr(findings))
    return 1 if any(finding.severity == "error" for finding in findings) else 0


def _recipe_findings(recipe, overrides: list[str]):
    from grpo_lab.cli.recipes import build_trainer

    trainer = build_trainer(recipe, overrides)
    try:
        return trainer.session.doctor()
    finally:
        trainer.close()


def _script_findings(script, overrides: list[str]):
    """Run ``script`` (its own arguments: ``overrides``) up to its ``GRPOTrainer.train()``, which runs
    the probe instead of training."""
    import runpy
    import traceback

    from grpo_lab.trainer.doctor import ProbeDone, probe_only

    argv, path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(script), *overrides], [str(script.resolve().parent)]
    try:
        with probe_only():
            runpy.run_path(str(script), run_name="__main__")
    except ProbeDone as done:
        return done.findings
    except SystemExit as exit_:
        raise ValueError(f"{script} exited (status {exit_.code}) before calling GRPOTrainer.train(); nothing was "
                         "probed.") from None
    except Exception:
        traceback.print_exc()
        raise ValueError(f"{script} raised before its GRPOTrainer.train() (traceback above); nothing was "
                         "probed. Fix the script (it runs as `python SCRIPT ARGS` would), then probe again.") from None
    finally:
        sys.argv, sys.path[:] = argv, path
    raise ValueError(f"{script} ended without calling grpo_lab's GRPOTrainer.train(): the doctor probes the run "
                     "that call would start (a script importing TRL's trainer: change the import to grpo_lab).")


def cmd_export(args: argparse.Namespace) -> int:
    import warnings

    from grpo_lab.export import export_notebook

    with warnings.catch_warnings(record=True) as caught:  # the export's warnings are said as the command's lines
        warnings.simplefilter("always", UserWarning)
        path = export_notebook(args.notebook, args.output)
    for warning in caught:
        if issubclass(warning.category, UserWarning):
            print(f"grpo-lab export: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    print(f"wrote {path}")
    return 0


def cmd_vllm_serve(args) -> int:
    from grpo_lab.rollout.vllm_server import serve

    serve(args.overrides)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from grpo_lab import __version__

    parser = argparse.ArgumentParser(prog="grpo-lab", description="Notebook-first GRPO for language models.")
    parser.add_argument("--version", action="version", version=f"grpo_lab {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser("demo", help="train the shipped tiny model with GRPO and report held-out accuracy")
    demo.add_argument("--steps", "--max_steps", dest="steps", type=_positive_int, default=None,
                      help="optimizer steps (default: the task's max_steps)")
    demo.add_argument("--output-dir", "--output_dir", dest="output_dir", default="outputs/demo",
                      help="where the model, history and curve go")
    demo.add_argument("--eval-size", "--eval_size", dest="eval_size", type=_positive_int, default=200,
                      help="number of held-out problems")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    demo.set_defaults(handler=cmd_demo)

    evaluate = commands.add_parser("eval", help="evaluate a model on the embedded task's held-out split")
    evaluate.add_argument("--model", help="model directory (default: the shipped tiny model)")
    evaluate.add_argument("--eval-size", "--eval_size", dest="eval_size", type=_positive_int, default=200,
                          help="number of held-out problems")
    evaluate.add_argument("--k", type=_positive_int, default=8, help="samples per problem for pass@k")
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    evaluate.set_defaults(handler=cmd_eval)

    train = commands.add_parser(
        "train", help="train from a YAML recipe; --<config field> VALUE overrides",
        epilog="Any GRPOConfig field may follow the recipe as --FIELD VALUE and overrides it, e.g. "
        "--learning_rate 1e-5 --max_steps 200 --output_dir runs/a. The fields, their defaults and meanings: "
        "python -c 'from grpo_lab import GRPOConfig; print(GRPOConfig.help_text())'.",
    )
    train.add_argument("recipe", help="YAML file: GRPOConfig fields plus model / reward_funcs / datasets")
    train.add_argument("--resume_from", default=None, help="checkpoint directory to continue from")
    train.add_argument("--json", action="store_true", help="print the last metrics row as JSON")
    train.set_defaults(handler=cmd_train)

    doctor = commands.add_parser(
        "doctor", help="probe a run (a recipe, or a script that calls GRPOTrainer.train()) and say why it would "
        "not learn; exit status 1 on an error finding",
        epilog="A recipe takes --FIELD VALUE overrides as `grpo-lab train` does; a script's own arguments follow "
        "it. The script runs up to its GRPOTrainer.train(), which runs the probe (one generation batch, scored, "
        "one loss pass, no update) instead of training. Every finding: docs/troubleshooting.md.",
    )
    doctor.add_argument("target", help="a recipe (.yaml) or a training script (.py)")
    doctor.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    doctor.set_defaults(handler=cmd_doctor)

    export = commands.add_parser("export", help="export a notebook's `export` cells to a training script")
    export.add_argument("notebook", help="the .ipynb file")
    export.add_argument("-o", "--output", default="train.py", help="script to write (default: train.py)")
    export.set_defaults(handler=cmd_export)

    serve = commands.add_parser(
        "vllm-serve", add_help=False,
        help="serve generations from vLLM for runs with vllm_mode='server' (see `grpo-lab vllm-serve --help`)",
    )
    serve.set_defaults(handler=cmd_vllm_serve)
    return parser


def _quiet_libraries() -> None:
    """Command output is ours: no per-file progress bars from the libraries underneath."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.command in ("train", "doctor", "vllm-serve"):
        args.overrides = extra
    elif extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command != "export":  # an export reads a notebook and writes a script: no library is loaded
        _quiet_libraries()
    from grpo_lab.doctor import DoctorStop

    args.out = sys.stdout
    # --json: stdout holds the one JSON object; what libraries print on the way (a DeepSpeed notice on a
    # CPU, a script's own output) goes to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else contextlib.nullcontext()
    try:
        with quiet:
            return args.handler(args)
    except (FileNotFoundError, ImportError, ValueError, TypeError, NotImplementedError) as error:
        print(f"grpo-lab {args.command}: error: {error}", file=sys.stderr)
        return 2
    except DoctorStop as stop:
        print(f"grpo-lab {args.command}: {stop}".replace("set doctor='warn'", "pass --doctor warn"), file=sys.stderr)
        return 1

