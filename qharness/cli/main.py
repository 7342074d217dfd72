"""``qharness`` command line: subcommands map to plain functions; run configs are typed (LightningCLI).

    qharness fit configs/qat_xnnpack.yaml [--trainer.max_steps 50] [--print_config]
    qharness calibrate configs/ptq_xnnpack.yaml   # PTQ: calibrate -> .pte + parity
    qharness validate|test CONFIG [--ckpt_path last]
    qharness export CONFIG [--ckpt_path last]      # .pte + parity + summary.json from a checkpoint
    qharness evaluate CONFIG [--tasks qharness_ppl,hellaswag] [--limit 32]   # lm-eval: FP / fake-quant / .pte
    qharness sensitivity CONFIG [--candidates fp,8da4w-g32] [--unit block] [--against recipe]   # per-layer cost
    qharness autotune CONFIG --max_size_mb 2.0      # per-layer precision under a size budget -> autotuned.yaml, .pte
    qharness recipes                                # the known backend recipes
    qharness generate --pte runs/x/model.pte --prompt "To be" [--temperature 0]
    qharness generate runs/x --chat [--prompt "Hi"] [--system TEXT]   # chat template, stops at end-of-turn
    qharness bench --pte runs/x/model.pte          # latency/memory/size vs the eager FP model
    qharness bench --pte a/model.pte --pte b/model.pte [--processes 5]   # joint: fresh processes, alternating rounds
    qharness profile --pte a/model.pte [--pte b/model.pte]   # where the time goes, operator by operator (ETDump)
    qharness report runs/ [--max_latency_ms 2]      # accuracy vs latency table + Pareto plot of every run
    qharness sweep configs/sweep_xnnpack.yaml       # FP baseline + recipes x modes, then the report
    qharness ship configs/ship_xnnpack.yaml --max_ppl_increase 2% [--max_size_mb 2]   # which recipe to ship

Heavy libraries (lightning, executorch, torchao) are imported only by the subcommands that use them,
so ``qharness --help`` answers at once.
"""

from __future__ import annotations

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
    "sensitivity": "per-layer quantization cost: held-out perplexity change per layer x precision (table, heat map, JSON)",
    "autotune": "per-layer precision under a .pte size budget (--max_size_mb): writes autotuned.yaml, runs and checks it",
    "recipes": "list the backend recipes",
    "generate": "stream text from a .pte (--pte PATH --prompt TEXT; RUN_DIR --chat: a conversation), with tokens/s",
    "bench": "load time, prefill/decode tokens/s, peak RSS and size of a .pte vs the eager FP model",
    "profile": "where a .pte's prefill and decode time goes, operator by operator (ExecuTorch ETDump), side by side",
    "report": "accuracy vs latency of every run under a directory: table, Pareto plot, best under a budget",
    "sweep": "run the FP baseline and recipes x modes (PTQ, QAT) from one sweep config, then the report",
    "ship": "which recipe to ship: climb int8 PTQ -> 4-bit PTQ -> mixed -> QAT until a candidate meets the tolerance",
}

# Run-config subcommands go through LightningCLI (api/jobs.run_argv, api/lightning_cli.py); the plain ones are the
# functions of cli/commands.py.
LIGHTNING = ("fit", "calibrate", "validate", "test", "export", "evaluate", "sensitivity", "autotune")
PLAIN = ("recipes", "generate", "bench", "profile", "report", "sweep", "ship")

# The option that places a plain subcommand's output (run configs: trainer.default_root_dir)
OUTPUT_FIELD = {"sweep": "sweep_dir", "ship": "ship_dir", "report": "--out", "bench": "--out"}

USAGE = "usage: qharness {" + ",".join(SUBCOMMANDS) + "} [CONFIG.yaml] [--field value ...] [--verbose]\n"


def _print_help() -> None:
    print(USAGE)
    print("Quantization training harness for on-device LLMs (QAT/PTQ -> ExecuTorch .pte).\n\nsubcommands:")
    for name, text in SUBCOMMANDS.items():
        print(f"  {name:<10} {text}")
    print("\n`qharness SUBCOMMAND --help` lists every config field with its documentation.")
    print(
        "--verbose (or QHARNESS_VERBOSE=1) shows every upstream message, including those qharness/upstream/quiet.py hides."
    )


def rewrite_argv(argv: list[str]) -> list[str]:
    """Accept a positional config: ``fit x.yaml`` -> ``fit --config x.yaml`` (any first argument that is no option:
    a directory or a missing file is then named as the config it was meant to be); ``evaluate --ckpt`` =
    ``--ckpt_path``."""
    out = list(argv)
    if len(out) >= 2 and not out[1].startswith("-"):
        out[1:2] = ["--config", out[1]]
    if out and out[0] == "evaluate":
        out = [
            "--ckpt_path" if a == "--ckpt" else "--ckpt_path=" + a[7:] if a.startswith("--ckpt=") else a for a in out
        ]
    return out


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
    from qharness.io.disk import name_output_field

    # what a disk-full error tells the user to point elsewhere (a sweep's runs learn theirs from the environment);
    # restored when this command returns (main may run again in the same process)
    previous_field = name_output_field(OUTPUT_FIELD[argv[0]]) if argv[0] in OUTPUT_FIELD else None

    try:
        if argv[0] in PLAIN:
            from qharness.cli import commands
            from qharness.cli.args import call

            call(getattr(commands, argv[0]), argv[1:], prog=f"qharness {argv[0]}")
            return
        argv = rewrite_argv(argv)
        from qharness.api.jobs import run_argv

        try:
            run_argv(argv)  # the config checked before torch loads, then LightningCLI
        except SystemExit as e:  # Lightning stops on SIGTERM with SIGTERMException (a SystemExit of code None)
            if type(e).__name__ == "SIGTERMException":
                print(
                    "error: stopped by SIGTERM; the run's last.ckpt holds the last finished step. fix: resume with --ckpt_path last",
                    file=sys.stderr,
                )
                raise SystemExit(143) from None
            raise
    except UserError as e:
        _fail(str(e))
    except (FloatingPointError, ParityError) as e:  # divergence (last good checkpoint kept) or a .pte not to ship
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:
        from qharness.io.disk import disk_full_error_of

        full = disk_full_error_of(e)  # a write anywhere (Lightning's logs, a library's save) ran out of space
        if full is None:
            raise
        _fail(str(full))
    finally:
        from qharness.io.locks import release_run_locks

        release_run_locks()  # the command is over: the run directory is free for the next one
        if previous_field is not None:
            name_output_field(previous_field)


def console() -> None:
    """The ``qharness`` command (``python -m qharness`` too): ``main()``, then an exit without the interpreter's final
    garbage collection (``upstream/process.exit_without_final_collection``: 2 s less after a run)."""
    from qharness.upstream.process import exit_without_final_collection

    try:
        main()
    finally:
        exit_without_final_collection()
