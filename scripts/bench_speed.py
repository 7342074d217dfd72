"""Speed benchmark: ``.pte`` decode/prefill per recipe, the bandwidth bound, the export_llm peer,
QAT step cost, calibration throughput and export + lowering time, all measured in one run.

Part 1, deployed speed, on ``--model`` (default ``smollm2-135m``: SmolLM2-135M's shape with random weights,
built once; speed depends on shapes, not on weight values; or ``benchmark``, or an HF Llama directory):
for xnnpack_fp32, xnnpack_int8_dynamic, xnnpack_int4w_dynamic and xnnpack_8da4w our ``.pte`` is exported
(PTQ; calibration throughput and export + lowering time are recorded), ExecuTorch's own LLM export
(``export_llama``, 8da4w, group 32) of the same weights is the peer, and the eager PyTorch model is the
floor. All are then timed with ``qharness.runtime.joint.interleaved`` (prefill ``--prompt_len`` tokens in one call,
decode ``--decode_tokens`` one by one; ``--processes`` fresh processes per program, alternating rounds, one thread
count); each speed ratio is taken per round (process k of A against process k of B) and given as median
(min-max) over the rounds. Decode is also given as a fraction of the memory-bandwidth bound (measured copy
bandwidth / the weight bytes a decode step reads: the ``.pte`` less its embedding tables, one row of which a token
reads).

Part 2, on the benchmark model (``--train_model``, default ``benchmark``: the embedded architecture pretrained
on tinyshakespeare, as in bench_quality.py; ``embedded`` when that text is absent): one training step
(forward, backward, AdamW) of each recipe's QAT model divided by the FP step on the same batch, and the
export_llm peer's 8da4w ``.pte`` against ours for perplexity on held-out text (both through the runtime).

Targets: int8 ``.pte`` decode >= 2x the fp32 ``.pte``; the best 4-bit recipe >= 2.5x; QAT step <= 1.5x FP;
our 8da4w ``.pte`` at least as fast and as accurate as export_llm's. A ratio is "MET" only when its whole
spread meets the target, "TIE/UNDECIDED" when the spread straddles it.

    python scripts/bench_speed.py                          # about 20 min here
    python scripts/bench_speed.py --model benchmark --processes 2 --reps 3
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
RECIPES = ["xnnpack_fp32", "xnnpack_int8_dynamic", "xnnpack_int4w_dynamic", "xnnpack_8da4w"]
PEER = "export_llm 8da4w"


def resolve_model(name: str, work: Path) -> Path:
    """A local HF model directory for ``name``: smollm2-135m (built once under ``work``), benchmark, embedded or a path."""
    if name == "smollm2-135m":
        import scale

        out = work / "smollm2-135m-random"
        if not (out / "config.json").is_file():
            print(f"building the random-init SmolLM2-135M-shaped model in {out} (once) ...", flush=True)
            scale.make_model(out, "135m")
        return out
    if name == "benchmark":
        import bench_quality

        if not bench_quality.DEFAULT_CORPUS.is_file():
            print(
                f"{bench_quality.DEFAULT_CORPUS} is absent: the benchmark model falls back to the embedded default",
                flush=True,
            )
            return resolve_model("embedded", work)
        return bench_quality.benchmark_model(str(bench_quality.DEFAULT_CORPUS.resolve()), bench_quality.PRETRAIN_STEPS)
    if name == "embedded":
        from qharness.sources.embedded import embedded_dir

        return embedded_dir()
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        sys.exit(
            f"error: --model {path} is not an HF model directory (no config.json). fix: smollm2-135m, benchmark, embedded or a save_pretrained directory"
        )
    return path


def text_data(model_dir: Path, seq_len: int = 128):
    """The runs' data split (``TextDataModule``) with ``model_dir``'s tokenizer: tinyshakespeare when present, else
    the embedded corpus. ``train_x`` feeds calibration and training steps, ``val_x``/``val_y`` the held-out scoring."""
    import bench_quality

    from qharness.data.datamodule import TextDataModule

    source = str(bench_quality.DEFAULT_CORPUS) if bench_quality.DEFAULT_CORPUS.is_file() else "embedded"
    dm = TextDataModule(source=source, tokenizer=str(model_dir), seq_len=seq_len, batch_size=1)
    dm.setup()
    return dm


def export_ours(model, tokenizer, recipe_name: str, max_seq_len: int, path: Path, calib: torch.Tensor) -> dict:
    """Our PTQ ``.pte`` of ``recipe_name``: export+quantize and lowering times, calibration tokens/s."""
    from qharness.deploy.deployed import export_path
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.run.pipeline import eos_ids
    from qharness.training.calibration import calibrate

    recipe = load_recipe(recipe_name)
    calib_s = []

    def timed_calibrate(graph):
        t = time.perf_counter()
        calibrate(graph, calib)
        calib_s.append(time.perf_counter() - t)

    t = time.perf_counter()
    deployed = quantize_for_deploy(copy.deepcopy(model), recipe, max_seq_len, timed_calibrate)
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    meta = runner_metadata(max_seq_len, model.config.vocab_size, tokenizer.bos_token_id, eos_ids(model, tokenizer))
    path.write_bytes(lower_to_pte(deployed, recipe, max_seq_len, meta))
    lower_s = time.perf_counter() - t
    out = {"export_quantize_s": export_s, "lower_s": lower_s, "export_path": export_path(deployed)}
    if calib_s:
        out["calibration_tok_s"] = calib.numel() / calib_s[0]
    return out


def time_all(paths: dict, vocab: int, prompt_len: int, decode_tokens: int, reps: int, processes: int) -> dict:
    """``qharness.runtime.joint.interleaved`` over every program; per program the median over processes of the per-process
    medians (tok/s) and the per-process values (``decode_per_process``, ``prefill_per_process``) for pairwise ratios."""
    from qharness.runtime.joint import interleaved
    from qharness.runtime.spread import max_over_min

    programs = {name: {"kind": kind, "path": str(path), "vocab_size": vocab} for name, (kind, path) in paths.items()}
    joint = interleaved(programs, prompt_len, decode_tokens, reps, processes)
    return {
        name: {
            "prefill_tok_s": p["prefill_tok_s"]["median"],
            "decode_tok_s": p["decode_tok_s"]["median"],
            "decode_max_over_min": max_over_min(p["decode_tok_s"]),
            "decode_per_process": p["decode_tok_s"]["per_process"],
            "prefill_per_process": p["prefill_tok_s"]["per_process"],
            "size_bytes": p["size_bytes"],
            "weight_bytes": p["weight_bytes"],
            "threads": joint["threads"],
            "load_avg_1m": joint["load_avg_1m"],
        }
        for name, p in joint["programs"].items()
    }


def step_times(
    model_dir: Path, recipes: list[str], batch_size: int, seq_len: int, steps: int, profile: str | None
) -> dict:
    """Median seconds of one training step (forward, loss, backward, AdamW) on one fixed batch: the FP model
    exported for training (what an FP fine-tune trains), the eager FP model, and each recipe's QAT model."""
    import torch.nn.functional as F

    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer
    from qharness.training.prepare import LogitsOnly, export_for_training, prepare_for_training
    from qharness.upstream import imports

    base, _ = load_model_and_tokenizer(str(model_dir))
    dm = text_data(model_dir, seq_len)
    x, y = dm.train_x[:batch_size], dm.train_y[:batch_size]

    def timed(graph, name):
        if isinstance(graph, torch.fx.GraphModule):
            imports.pt2e().move_to_train(graph)
        else:
            graph.train()
        opt = torch.optim.AdamW(graph.parameters(), lr=1e-5)

        def step():
            loss = F.cross_entropy(graph(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(2):  # warm-up: observers initialise, allocator settles
            step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        if profile == name:
            with torch.profiler.profile() as prof:
                step()
            print(f"\nprofile of one {name} QAT step (top ops by self CPU time):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        return statistics.median(times)

    out = {
        "fp_exported": timed(export_for_training(copy.deepcopy(base), batch_size, seq_len), "fp"),
        "fp_eager": timed(LogitsOnly(copy.deepcopy(base)), "fp_eager"),
    }
    for name in recipes:
        recipe = load_recipe(name)
        if recipe.quantized:
            out[name] = timed(prepare_for_training(copy.deepcopy(base), recipe, batch_size, seq_len, is_qat=True), name)
    return out


def peer_accuracy(model_dir: Path, work: Path, blocks: int, max_seq_len: int) -> dict:
    """Perplexity of our 8da4w ``.pte`` and export_llm's on the same held-out blocks, both through the runtime
    (one token per call: export_llm's ``.pte`` returns last-token logits), on the benchmark model."""
    import bench_fastpath

    from qharness.checks.parity import score_deployed
    from qharness.runtime.pte import PteModel
    from qharness.sources.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    dm = text_data(model_dir)
    calib = dm.train_x[:16]
    work.mkdir(parents=True, exist_ok=True)
    ours = {
        name: work / f"{name}.pte" for name in ("xnnpack_8da4w", "xnnpack_8da4w_hqq")
    }  # min-max / HQQ scales (export_llm's default)
    for name, path in ours.items():
        export_ours(model, tokenizer, name, max_seq_len, path, calib)
    theirs = bench_fastpath.export_theirs(
        model,
        bench_fastpath.KINDS["8da4w"][1],
        max_seq_len,
        work / "export_llm",
        tokenizer.bos_token_id,
        [tokenizer.eos_token_id],
        fast_lowering=True,
    )["path"]
    x, y = dm.val_x[:blocks], dm.val_y[:blocks]
    out = {}
    for name, path in [*ours.items(), ("theirs", Path(theirs))]:
        pte, vocab = PteModel(path), model.config.vocab_size
        # export_llm's .pte returns [1, vocab] (the last position); as [1, positions, vocab] both score alike
        out[name] = score_deployed(
            lambda t, s, pte=pte, vocab=vocab: pte(t, s).reshape(1, -1, vocab), x, y, desc=f"scoring {name} .pte"
        )["ppl"]
    with torch.no_grad():
        out["fp_eager"] = math.exp(
            torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
        )
    n = y.numel()
    out["blocks"], out["tokens"] = len(x), n
    return out


def table(rows: list[tuple]) -> str:
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, width)) for r in rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="deployed-speed model: smollm2-135m, benchmark, embedded or an HF Llama directory",
    )
    p.add_argument(
        "--train_model",
        default="benchmark",
        help="QAT-step and peer-accuracy model: benchmark, embedded or a directory",
    )
    p.add_argument("--recipes", nargs="+", default=RECIPES)
    p.add_argument("--out", default="runs/bench_speed", help="directory for the .pte files and results.json")
    p.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "qharness-135m",
        help="where smollm2-135m is built",
    )
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--decode_tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=10, help="repetitions per fresh process (after a warm-up)")
    p.add_argument(
        "--processes", "--rounds", type=int, default=5, help="fresh processes per program, alternating rounds"
    )
    p.add_argument("--train_batch", type=int, default=16, help="QAT/FP step batch (x 128 tokens)")
    p.add_argument("--train_steps", type=int, default=5, help="timed steps per model (after 2 warm-up steps)")
    p.add_argument("--profile", default=None, help="print torch.profiler's top ops of one QAT step of this recipe")
    p.add_argument(
        "--peer_blocks", type=int, default=32, help="held-out blocks of 128 tokens for the peer accuracy check"
    )
    p.add_argument("--no_peer", action="store_true", help="skip ExecuTorch's export_llm peer")
    p.add_argument(
        "--upstream_lowering",
        action="store_true",
        help="export the peer without qharness.upstream.lowering.fast_lowering "
        "(the same .pte; upstream lowering of the 135M model took over 10 minutes here)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="time the .pte files an earlier run left in --out (their export times come from export.json)",
    )
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    from qharness.runtime.measure import memory_bandwidth
    from qharness.runtime.spread import format_spread, pair_ratios, spread, verdict
    from qharness.sources.models import load_model_and_tokenizer

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    model_dir = resolve_model(a.model, a.work)
    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    calib = text_data(model_dir).train_x[:16]

    # part 1: deployed speed
    exports, paths = {}, {}
    record = out / "export.json"
    earlier = json.loads(record.read_text()) if a.reuse and record.is_file() else {}
    for name in a.recipes:
        paths[name] = ("pte", out / f"{name}.pte")
        if name in earlier and paths[name][1].is_file():
            exports[name] = earlier[name]
            continue
        print(f"exporting + lowering {name} ...", flush=True)
        exports[name] = export_ours(model, tokenizer, name, a.max_seq_len, paths[name][1], calib)
        record.write_text(json.dumps(exports, indent=2))
    if not a.no_peer:
        import bench_fastpath

        print(f"exporting {PEER} (ExecuTorch's export_llama of the same weights) ...", flush=True)
        r = bench_fastpath.export_theirs(
            model,
            bench_fastpath.KINDS["8da4w"][1],
            a.max_seq_len,
            out / "export_llm",
            tokenizer.bos_token_id,
            [tokenizer.eos_token_id],
            fast_lowering=not a.upstream_lowering,
        )
        paths[PEER] = ("pte", Path(r["path"]))
        exports[PEER] = {"export_quantize_s": r["export_s"], "lower_s": 0.0, "export_path": "export_llm"}
    paths["eager PyTorch (FP32)"] = ("eager", model_dir)
    del model
    bandwidth = memory_bandwidth()
    print("timing ...", flush=True)
    speed = time_all(paths, vocab, a.prompt_len, a.decode_tokens, a.reps, a.processes)
    fp = speed.get("xnnpack_fp32")

    # part 2: training cost and peer accuracy on the benchmark model
    train_dir = resolve_model(a.train_model, a.work)
    print(f"timing training steps on {train_dir} ...", flush=True)
    steps = step_times(train_dir, a.recipes, a.train_batch, 128, a.train_steps, a.profile)
    accuracy = None if a.no_peer else peer_accuracy(train_dir, out / "peer_accuracy", a.peer_blocks, a.max_seq_len)

    # report
    print(
        f"\n== deployed speed: {a.model} ({n_params / 1e6:.1f}M parameters, FP32 {n_params * 4 / 2**20:.0f} MiB); prompt {a.prompt_len} "
        f"tokens, {a.decode_tokens} decode steps; {a.reps} reps x {a.processes} fresh processes per program, alternating rounds (median of the process "
        f"medians; ratios per round: median (min-max)); {next(iter(speed.values()))['threads']} threads; copy bandwidth {bandwidth:.1f} GB/s; "
        f"{os.cpu_count()} CPUs, load average {next(iter(speed.values()))['load_avg_1m'][0]:.1f} -> {next(iter(speed.values()))['load_avg_1m'][1]:.1f}"
    )
    rows = [
        (
            "program",
            "size MB",
            "prefill tok/s",
            "decode tok/s",
            "decode max/min",
            "decode x fp32 .pte",
            "prefill x fp32 .pte",
            "decode / bw bound",
            "export+lower s",
            "calib tok/s",
        )
    ]
    for name, s in speed.items():
        e = exports.get(name, {})
        bound = bandwidth * 1e9 / s["weight_bytes"]
        rows.append(
            (
                name,
                f"{s['size_bytes'] / 1e6:.1f}",
                f"{s['prefill_tok_s']:.1f}",
                f"{s['decode_tok_s']:.2f}",
                f"{s['decode_max_over_min']:.2f}",
                format_spread(pair_ratios(s["decode_per_process"], fp["decode_per_process"])) if fp else "n/a",
                format_spread(pair_ratios(s["prefill_per_process"], fp["prefill_per_process"])) if fp else "n/a",
                f"{s['decode_tok_s'] / bound:.0%}",
                f"{e['export_quantize_s'] + e['lower_s']:.0f}" if e else "",
                f"{e['calibration_tok_s']:.0f}" if "calibration_tok_s" in e else "",
            )
        )
    print(table(rows))
    print(
        f"\n== training step on {a.train_model} ({train_dir.name}), batch {a.train_batch} x 128, median of {a.train_steps} steps"
    )
    rows = [("model", "s/step", "x FP (exported)", "x FP (eager)")]
    for name, s in steps.items():
        rows.append((name, f"{s:.3f}", f"{s / steps['fp_exported']:.2f}", f"{s / steps['fp_eager']:.2f}"))
    print(table(rows))
    if accuracy:
        print(
            f"\n== peer accuracy on {a.train_model}: held-out perplexity, {accuracy['blocks']} blocks ({accuracy['tokens']} tokens), .pte through the runtime"
        )
        print(
            f"ours xnnpack_8da4w {accuracy['xnnpack_8da4w']:.3f}   ours xnnpack_8da4w_hqq {accuracy['xnnpack_8da4w_hqq']:.3f}   "
            f"export_llm 8da4w (HQQ scales) {accuracy['theirs']:.3f}   eager FP32 {accuracy['fp_eager']:.3f}"
        )

    print(
        "\n== targets (speed ratios: median (min-max) over the rounds' fresh-process pairs; single measurements: one value)"
    )

    def ratio(a_name, b_name, key="decode"):  # tok/s of A over B, process by process
        return pair_ratios(speed[a_name][f"{key}_per_process"], speed[b_name][f"{key}_per_process"])

    checks = []
    if fp and "xnnpack_int8_dynamic" in speed:
        checks.append(("int8 .pte decode >= 2x fp32 .pte", ratio("xnnpack_int8_dynamic", "xnnpack_fp32"), 2.0, True))
    four = [n for n in ("xnnpack_int4w_dynamic", "xnnpack_8da4w") if n in speed]
    if fp and four:
        best = max(four, key=lambda n: speed[n]["decode_tok_s"])
        checks.append((f"best 4-bit .pte decode ({best}) >= 2.5x fp32 .pte", ratio(best, "xnnpack_fp32"), 2.5, True))
    for name in a.recipes:
        if name in steps:
            checks.append(
                (f"{name} QAT step <= 1.5x FP step", spread([steps[name] / steps["fp_exported"]]), 1.5, False)
            )
    if PEER in speed and "xnnpack_8da4w" in speed:  # ms/token ours over theirs = their tok/s over ours
        checks.append(("8da4w decode ours / export_llm <= 1.0", ratio(PEER, "xnnpack_8da4w"), 1.0, False))
        checks.append(("8da4w prefill ours / export_llm <= 1.0", ratio(PEER, "xnnpack_8da4w", "prefill"), 1.0, False))
    if accuracy:
        checks.append(
            (
                "8da4w PTQ ppl ours (xnnpack_8da4w_hqq) / export_llm <= 1.0",
                spread([accuracy["xnnpack_8da4w_hqq"] / accuracy["theirs"]]),
                1.0,
                False,
            )
        )
    for label, value, target, higher in checks:
        shown = format_spread(value) if len(value["per_process"]) > 1 else f"{value['median']:.2f}"
        print(f"{label}: {shown} {verdict(value, target, higher)}")
    print(f"(whole run {time.perf_counter() - t_all:.0f} s)")
    result = {
        "args": {k: str(v) for k, v in vars(a).items()},
        "params": n_params,
        "bandwidth_gb_s": bandwidth,
        "speed": speed,
        "exports": exports,
        "train_step_s": steps,
        "peer_accuracy": accuracy,
        "load_avg": os.getloadavg(),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
