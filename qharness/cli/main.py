"""``qharness`` command line: subcommands map to plain functions; run configs are typed (LightningCLI).

    qharness fit configs/qat_xnnpack.yaml [--trainer.max_steps 50] [--print_config]
    qharness calibrate configs/ptq_xnnpack.yaml   # PTQ: calibrate -> .pte + parity
    qharness validate|test CONFIG [--ckpt_path last]
    qharness export CONFIG [--ckpt_path last]      # .pte + parity + summary.json from a checkpoint
    qharness evaluate CONFIG [--tasks qharness_ppl,hellaswag] [--limit 32]   # lm-eval: FP / fake-quant / .pte
    qharness recipes                                # the known backend recipes
    qharness generate --pte runs/x/model.pte --prompt "To be" [--temperature 0]
    qharness bench --pte runs/x/model.pte          # latency/memory/size vs the eager FP model
    qharness bench --pte a/model.pte --pte b/model.pte [--processes 5]   # joint: round-robin fresh processes
    qharness report runs/ [--max_latency_ms 2]      # accuracy vs latency table + Pareto plot of every run
    qharness sweep configs/sweep_xnnpack.yaml       # FP baseline + recipes x modes, then the report

Heavy libraries (lightning, executorch, torchao) are imported only by the subcommands that use them,
so ``qharness --help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys

from qharness.upstream import quiet

SUBCOMMANDS = {
    "fit": "train with quantization-aware training, then export, lower and check the .pte",
    "calibrate": "post-training quantization: calibrate, convert, export, lower and check the .pte",
    "validate": "validation loss/perplexity of the (fake-quant) model, optionally from --ckpt_path",
    "test": "same as validate, on the test dataloader",
    "export": "export a trained checkpoint (--ckpt_path, default last) to .pte, with the parity gate",
    "evaluate": "lm-eval table of a run: FP vs fake-quant vs .pte [--pte PATH --ckpt PATH --tasks a,b --limit N --num_fewshot K]",
    "recipes": "list the backend recipes",
    "generate": "stream text from a .pte (--pte PATH --prompt TEXT), with tokens/s",
    "bench": "load time, prefill/decode tokens/s, peak RSS and size of a .pte vs the eager FP model",
    "report": "accuracy vs latency of every run under a directory: table, Pareto plot, best under a budget",
    "sweep": "run the FP baseline and recipes x modes (PTQ, QAT) from one sweep config, then the report",
}

USAGE = "usage: qharness {" + ",".join(SUBCOMMANDS) + "} [CONFIG.yaml] [--field value ...] [--verbose]\n"


def _print_help() -> None:
    print(USAGE)
    print("Quantization training harness for on-device LLMs (QAT/PTQ -> ExecuTorch .pte).\n\nsubcommands:")
    for name, text in SUBCOMMANDS.items():
        print(f"  {name:<10} {text}")
    print("\n`qharness SUBCOMMAND --help` lists every config field with its documentation.")
    print("--verbose (or QHARNESS_VERBOSE=1) shows every upstream message, including those qharness/upstream/quiet.py hides.")


def rewrite_argv(argv: list[str]) -> list[str]:
    """Accept a positional config: ``fit x.yaml`` -> ``fit --config x.yaml``; ``evaluate --ckpt`` = ``--ckpt_path``."""
    out = list(argv)
    if len(out) >= 2 and out[1].endswith((".yaml", ".yml")) and not out[1].startswith("-"):
        out[1:2] = ["--config", out[1]]
    if out and out[0] == "evaluate":
        out = ["--ckpt_path" if a == "--ckpt" else "--ckpt_path=" + a[7:] if a.startswith("--ckpt=") else a for a in out]
    return out


def _option(argv: list[str], name: str):
    """The last value given to ``--name VALUE`` or ``--name=VALUE`` (None if absent)."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1 :]
    return value


def check_tasks_early(argv: list[str]) -> None:
    """lm-eval task names (and whether their data can be reached) checked before Lightning is even imported,
    so a typo or an offline machine fails in a second or two; the full config check follows in preflight."""
    if argv[0] not in ("fit", "calibrate", "export", "evaluate"):
        return
    import yaml

    ev = {}
    config = _option(argv, "--config")
    if config and os.path.isfile(config):
        try:
            ev = (yaml.safe_load(open(config)) or {}).get("eval") or {}
        except (yaml.YAMLError, AttributeError):
            return  # LightningCLI reports a broken config
    if not isinstance(ev, dict):
        return
    tasks = _option(argv, "--tasks" if argv[0] == "evaluate" else "--eval.tasks") or _option(argv, "--eval.tasks") or ev.get("tasks")
    enabled = str(_option(argv, "--eval.enabled") or ev.get("enabled", True)).lower() not in ("false", "0", "no")
    if tasks is None or (argv[0] != "evaluate" and not enabled):
        return
    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.strip("[]").split(",") if t.strip()]
    from qharness.evaluation.tasks import check_tasks

    check_tasks([str(t) for t in tasks], _option(argv, "--eval.include_path") or ev.get("include_path"))


def list_recipes() -> None:
    from qharness.recipes.registry import known_recipes, load_recipe

    rows = [load_recipe(n) for n in known_recipes()]
    width = max(len(r.name) for r in rows)
    for r in rows:
        print(f"{r.name:<{width}}  {r.backend:<8} {'/'.join(r.modes):<8} {r.description}")


def generate_cmd(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="qharness generate", description=SUBCOMMANDS["generate"])
    p.add_argument("--pte", required=True, help="the .pte file")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=None, help="fixed seed: the same text every run")
    p.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: tokenizer/ beside the .pte)")
    a = p.parse_args(argv)
    from pathlib import Path

    from qharness.runtime.generate import generate, load_tokenizer
    from qharness.runtime.pte import PteModel

    tokenizer = load_tokenizer(a.tokenizer or Path(a.pte).parent / "tokenizer")
    pte = PteModel(a.pte)

    def stream(piece: str) -> None:
        print(piece, end="", flush=True)

    stream(a.prompt)
    out = generate(pte, tokenizer, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed, on_text=stream)
    print()
    print(f"[{out['prompt_tokens']} prompt tokens, {len(out['new_tokens'])} generated] prefill {out['prefill_tok_s']:.1f} tok/s, "
          f"decode {out['decode_tok_s']:.1f} tok/s", file=sys.stderr)


def bench_cmd(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="qharness bench", description=SUBCOMMANDS["bench"] + " (the eager model when a summary.json lies beside the "
                                ".pte). Several --pte (or --processes): every program timed in N fresh processes each, round-robin, "
                                "with the spread over processes; added to each summary.json as bench_joint")
    p.add_argument("--pte", required=True, action="append", help="a .pte file; repeat to time several jointly")
    p.add_argument("--prompt_len", type=int, default=128, help="tokens prefilled in one call")
    p.add_argument("--decode_tokens", type=int, default=64, help="tokens decoded one at a time after the prefill")
    p.add_argument("--reps", type=int, default=None, help="repetitions per process (median and min-max reported; default 5, joint 10)")
    p.add_argument("--processes", type=int, default=None, help="fresh processes per program, round-robin (default 5 with several --pte)")
    p.add_argument("--threads", type=int, default=None, help="ExecuTorch/torch threads in every process (default: the cores free now)")
    p.add_argument("--out", default=None, help="also write the joint result to this JSON file")
    a = p.parse_args(argv)
    from pathlib import Path

    from qharness.errors import UserError
    from qharness.io import write_json_atomic
    from qharness.run.summary import RunSummary

    if a.threads is not None and a.threads < 1:
        raise UserError(f"bench --threads must be >= 1 (got {a.threads})", fix="pass --threads 1, or leave it out (free cores)")
    if a.processes is not None and a.processes < 1:
        raise UserError(f"bench --processes must be >= 1 (got {a.processes})", fix="pass --processes 5")
    if len(a.pte) > 1 or a.processes is not None:
        from qharness.runtime.bench import bench_jointly, format_joint, joint_entry

        for pte in a.pte:
            if not Path(pte).is_file():
                raise UserError(f".pte file {pte} does not exist")
        joint = bench_jointly(a.pte, a.prompt_len, a.decode_tokens, a.reps or 10, 5 if a.processes is None else a.processes, a.threads)
        print(format_joint(joint))
        if a.out:
            write_json_atomic(Path(a.out), joint)
            print(f"joint result written to {a.out}")
        for pte in a.pte:
            summary_path = Path(pte).parent / "summary.json"
            if summary_path.is_file() and len({Path(x).parent for x in a.pte}) == len(a.pte):  # one .pte per run dir
                RunSummary.update(summary_path, bench_joint=joint_entry(joint, pte))
                print(f"bench_joint added to {summary_path}")
        return

    from qharness.runtime.bench import bench, format_bench

    summary_path = Path(a.pte[0]).parent / "summary.json"
    summary = RunSummary.read(summary_path) if summary_path.is_file() else None
    model_dir = None
    if summary is not None:
        # The eager comparison loads the run's model only from this machine (a directory, or the embedded default):
        # a summary.json lying beside a downloaded .pte never makes qharness build, import or download anything.
        if summary.model == "embedded" or Path(summary.model).expanduser().is_dir():
            from qharness.sources.models import resolve_checkpoint

            model_dir = resolve_checkpoint(summary.model)
        else:
            print(f"eager FP comparison skipped: the model of {summary_path} ({summary.model!r}) is not a local directory", file=sys.stderr)
    result = bench(a.pte[0], model_dir, a.prompt_len, a.decode_tokens, a.reps or 5, a.threads)
    print(format_bench(result))
    if summary is not None:
        RunSummary.update(summary_path, bench=result)
        print(f"bench results added to {summary_path}")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    argv = quiet.take_verbose_flag(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        _print_help()
        return
    if argv[0] not in SUBCOMMANDS:
        _fail(f"unknown subcommand {argv[0]!r}. fix: use one of {', '.join(SUBCOMMANDS)}")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    quiet.install()  # known-harmless upstream messages hidden (not with --verbose)
    from qharness.errors import ParityError, UserError

    try:
        if argv[0] == "recipes":
            list_recipes()
            return
        if argv[0] in ("generate", "bench"):
            (generate_cmd if argv[0] == "generate" else bench_cmd)(argv[1:])
            return
        if argv[0] in ("report", "sweep"):
            from qharness.reporting import report, sweep

            (report.report_cmd if argv[0] == "report" else sweep.sweep_cmd)(argv[1:])
            return
        argv = rewrite_argv(argv)
        check_tasks_early(argv)
        from qharness.cli.lightning import run_lightning_cli

        try:
            run_lightning_cli(argv)
        except SystemExit as e:  # Lightning stops on SIGTERM with SIGTERMException (a SystemExit of code None)
            if type(e).__name__ == "SIGTERMException":
                print("error: stopped by SIGTERM; the run's last.ckpt holds the last finished step. fix: resume with --ckpt_path last", file=sys.stderr)
                raise SystemExit(143) from None
            raise
    except UserError as e:
        _fail(str(e))
    except (FloatingPointError, ParityError) as e:  # divergence (last good checkpoint kept) or a .pte not to ship
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
