"""How long a bad run config takes to fail: from the command to the error line (target: under 3 s).

Each case is one mistake in a small valid config (or a broken file); every repetition is a fresh
``python -m qharness fit --config ...`` process, timed from its start to its exit. Prints, per case, the
median and min-max seconds over the repetitions, the exit code, whether all repetitions stayed under the
target, and the error line. ``--baseline`` adds one mistake that only the full LightningCLI check finds
(``trainer.precision bf16-true`` with QAT: torch and Lightning load first), for contrast.

    python scripts/bench_validation.py                  # 5 repetitions per case
    python scripts/bench_validation.py --reps 3 --baseline
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 3.0
GOOD = {
    "model": {"checkpoint": "embedded", "recipe": "xnnpack_int8_dynamic", "mode": "qat", "lr": 1e-4},
    "data": {"source": "embedded", "seq_len": 32, "batch_size": 4},
    "trainer": {"max_steps": 6},
    "deploy": {"max_seq_len": 64},
    "bench": {"prompt_len": 16, "decode_tokens": 8},
}


def cases(tmp: Path) -> dict[str, tuple[Path, list[str]]]:
    """``name: (config file, extra arguments)``, each with one mistake."""

    def config(name, text=None, **change):
        cfg = yaml.safe_load(yaml.safe_dump(GOOD))
        for section, values in change.items():
            cfg.setdefault(section, {}).update(values)
        path = tmp / f"{name}.yaml"
        path.write_text(text if text is not None else yaml.safe_dump(cfg))
        return path

    return {
        "bad lr": (config("lr", model={"lr": -1}), []),
        "bad lr (override)": (config("good"), ["--model.lr", "-1"]),
        "unknown field": (config("field", model={"recipee": "x"}), []),
        "missing config file": (tmp / "nope.yaml", []),
        "YAML syntax error": (config("syntax", text="model: {lr: 1\n"), []),
        "unknown recipe": (config("recipe", model={"recipe": "xnnpack_int3"}), []),
        "missing data.source": (config("source", data={"source": str(tmp / "none.txt")}), []),
        "bad parity value": (config("parity", parity={"min_argmax_agreement": 5.0}), []),
        "deploy.max_seq_len <= seq_len": (config("lengths", deploy={"max_seq_len": 32}), []),
    }


def run_once(config: Path, extra: list[str], cwd: Path) -> tuple[float, int, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    # -P keeps the current directory off the child's sys.path (no module planted there runs): name qharness's root
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-P", "-m", "qharness", "fit", "--config", str(config), *extra],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - start
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")] or result.stderr.splitlines()
    return seconds, result.returncode, lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="fresh processes per case")
    parser.add_argument("--baseline", action="store_true", help="add a mistake only LightningCLI finds (1 rep)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        todo = {name: (*case, args.reps) for name, case in cases(tmp).items()}
        if args.baseline:
            todo["baseline: bf16 QAT (LightningCLI)"] = (tmp / "good.yaml", ["--trainer.precision", "bf16-true"], 1)
        print(f"{'case':<32} {'median s':>8} {'min-max s':>13} {'rc':>3} {'<3 s':>5}  error line")
        for name, (config, extra, reps) in todo.items():
            runs = [run_once(config, extra, ROOT) for _ in range(reps)]
            times = [t for t, _, _ in runs]
            codes = sorted({rc for _, rc, _ in runs})
            ok = "yes" if max(times) < TARGET_S else "NO"
            spread = f"{min(times):.2f}-{max(times):.2f}"
            print(
                f"{name:<32} {statistics.median(times):>8.2f} {spread:>13} {','.join(map(str, codes)):>3} {ok:>5}  "
                f"{runs[-1][2][:110]}"
            )


if __name__ == "__main__":
    main()
