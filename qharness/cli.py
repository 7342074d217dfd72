"""``qharness`` command line: subcommands map to plain functions; run configs are typed (LightningCLI).

    qharness fit configs/qat_xnnpack.yaml [--trainer.max_steps 50] [--print_config]
    qharness calibrate configs/ptq_xnnpack.yaml   # PTQ: calibrate -> .pte + parity
    qharness validate|test CONFIG [--ckpt_path last]
    qharness export CONFIG [--ckpt_path last]      # .pte + parity + summary.json from a checkpoint
    qharness recipes                                # the known backend recipes

Heavy libraries (lightning, executorch, torchao) are imported only by the subcommands that use them,
so ``qharness --help`` answers at once.
"""

from __future__ import annotations

import os
import sys

SUBCOMMANDS = {
    "fit": "train with quantization-aware training, then export, lower and check the .pte",
    "calibrate": "post-training quantization: calibrate, convert, export, lower and check the .pte",
    "validate": "validation loss/perplexity of the (fake-quant) model, optionally from --ckpt_path",
    "test": "same as validate, on the test dataloader",
    "export": "export a trained checkpoint (--ckpt_path, default last) to .pte, with the parity gate",
    "recipes": "list the backend recipes",
}

USAGE = "usage: qharness {" + ",".join(SUBCOMMANDS) + "} [CONFIG.yaml] [--field value ...]\n"


def _print_help() -> None:
    print(USAGE)
    print("Quantization training harness for on-device LLMs (QAT/PTQ -> ExecuTorch .pte).\n\nsubcommands:")
    for name, text in SUBCOMMANDS.items():
        print(f"  {name:<10} {text}")
    print("\n`qharness SUBCOMMAND --help` lists every config field with its documentation.")


def rewrite_argv(argv: list[str]) -> list[str]:
    """Accept a positional config: ``fit x.yaml`` -> ``fit --config x.yaml``."""
    out = list(argv)
    if len(out) >= 2 and out[1].endswith((".yaml", ".yml")) and not out[1].startswith("-"):
        out[1:2] = ["--config", out[1]]
    return out


def list_recipes() -> None:
    from qharness.recipes import known_recipes, load_recipe

    rows = [load_recipe(n) for n in known_recipes()]
    width = max(len(r.name) for r in rows)
    for r in rows:
        print(f"{r.name:<{width}}  {r.backend:<8} {'/'.join(r.modes):<8} {r.description}")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _print_help()
        return
    if argv[0] not in SUBCOMMANDS:
        _fail(f"unknown subcommand {argv[0]!r}. fix: use one of {', '.join(SUBCOMMANDS)}")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from qharness.errors import ParityError, UserError

    try:
        if argv[0] == "recipes":
            list_recipes()
            return
        from qharness.lightning_cli import run_lightning_cli

        run_lightning_cli(rewrite_argv(argv))
    except UserError as e:
        _fail(str(e))
    except FloatingPointError as e:  # divergence: the last good checkpoint stays in <run>/checkpoints
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except ParityError as e:  # the run finished; its .pte is not to be shipped
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
