"""The plain subcommands as typed functions: their signatures and docstrings are the command line
(``qharness.cli.args``). Each imports what it needs when it runs, so ``qharness --help`` stays instant.

Example::

    from qharness.cli.commands import report
    report("runs/sweep_xnnpack", max_size_mb=2.0, no_wandb=True)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from qharness.config import check_generate_args
from qharness.errors import UserError


def recipes() -> None:
    """List the backend recipes: name, backend, modes, embedding tables (``w4-g32``: 4-bit groups of 32; ``fp32``),
    what ships."""
    from qharness.recipes.registry import known_recipes, load_recipe

    rows = [load_recipe(n) for n in known_recipes()]
    width = max(len(r.name) for r in rows)
    print(f"{'recipe':<{width}}  {'backend':<8} {'modes':<8} {'embedding':<9} description")
    for r in rows:
        print(f"{r.name:<{width}}  {r.backend:<8} {'/'.join(r.modes):<8} {r.embedding_scheme:<9} {r.description}")


def generate(
    path: str | None = None,
    *,
    pte: str | None = None,
    prompt: str | None = None,
    chat: bool = False,
    chat_template: str | None = None,
    system: str | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int | None = None,
    tokenizer: str | None = None,
) -> None:
    """Stream text from a .pte (our decode loop over the ExecuTorch runtime), with prefill/decode tokens/s on stderr;
    --chat: answers in the chat template, each stopping at end-of-turn, one turn (--prompt) or a conversation read
    from stdin (a user turn per line; an empty line, /exit or EOF ends it).

    Args:
        path: the .pte file or a run directory (its model.pte); or --pte.
        pte: the .pte file (or a run directory).
        prompt: text to continue (--chat: the user turn; without it, --chat reads turns from stdin).
        chat: render the prompt with the chat template and stop at its end-of-turn token.
        chat_template: --chat: a template file or the template text (default: the tokenizer's, which a run saves
            with its data.chat_template).
        system: --chat: the system turn.
        max_new_tokens: tokens to generate (default 64; --chat: 256 per answer).
        temperature: 0: greedy.
        top_k: sample among the k most likely tokens (0: all).
        seed: fixed seed: the same text every run.
        tokenizer: directory with tokenizer.json (default: tokenizer/ beside the .pte).
    """
    from qharness.api.pte import Pte

    if (path is None) == (pte is None):
        raise UserError(
            "generate takes one program: " + ("both PATH and --pte given" if path else "no PATH or --pte"),
            fix="pass qharness generate RUN_DIR_or_PTE (or --pte PATH)",
        )
    if not chat and (prompt is None or chat_template is not None or system is not None):
        what = "--prompt is required" if prompt is None else "--chat_template and --system need --chat"
        raise UserError(f"generate: {what}", fix='pass --prompt "TEXT", or --chat for a conversation')
    max_new_tokens = max_new_tokens if max_new_tokens is not None else 256 if chat else 64
    check_generate_args(max_new_tokens, temperature, top_k, seed)
    for option, text in (("--prompt", prompt), ("--system", system)):
        check_utf8(text, option)
    program = Pte.load(path or pte, tokenizer)  # a missing or foreign program is named first: the tokenizer's follows
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed, on_token=_stream)
    if chat:
        _chat(program, prompt, chat_template, system, sampling)
        return
    _stream(prompt)
    program.generate(prompt, **sampling)
    print()
    _report(program.last)
    if program.last["stopped"] == "context":
        out = program.last
        print(
            f"[stopped before {max_new_tokens} new tokens: the .pte's KV cache holds {out['context']} tokens, "
            f"{out['prompt_tokens']} of them the prompt; export with a larger deploy.max_seq_len for more]",
            file=sys.stderr,
        )


MAX_TURN_CHARS = 1_000_000  # characters of one user turn read from stdin (the KV cache holds far fewer tokens)


def check_utf8(text: str | None, option: str) -> None:
    """``text`` (from the command line, where bytes that are not UTF-8 arrive as surrogates) is UTF-8 text."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(
            f"{option} holds bytes that are not UTF-8 text (at character {e.start})",
            fix=f"pass {option} as UTF-8 text (check the terminal's encoding, e.g. LANG=C.UTF-8)",
        ) from None


def _read_turn() -> str:
    """One user turn (a line) from stdin as UTF-8 text; binary or overlong input is one line naming stdin."""
    try:
        line = sys.stdin.readline(MAX_TURN_CHARS + 1)
    except UnicodeDecodeError as e:
        raise UserError(
            f"generate --chat: stdin holds bytes that are not UTF-8 text ({e.reason} at byte {e.start})",
            fix="pipe UTF-8 text into generate --chat, a user turn per line",
        ) from None
    if len(line) > MAX_TURN_CHARS:
        raise UserError(
            f"generate --chat: a line of stdin is longer than {MAX_TURN_CHARS:,} characters",
            fix="pipe text into generate --chat, a user turn per line",
        )
    check_utf8(line, "generate --chat: stdin")  # undecodable bytes as surrogates (a C locale's surrogateescape)
    return line


def _stream(piece: str) -> None:
    print(piece, end="", flush=True)


def _report(out: dict) -> None:
    """The statistics line of a generation, on stderr."""
    prefilled = f" ({out['prefilled_tokens']} prefilled)" if out["prefilled_tokens"] != out["prompt_tokens"] else ""
    print(
        f"[{out['prompt_tokens']} prompt tokens{prefilled}, {len(out['new_tokens'])} generated] "
        f"prefill {out['prefill_tok_s']:.1f} tok/s, decode {out['decode_tok_s']:.1f} tok/s",
        file=sys.stderr,
    )


def _chat(program, prompt: str | None, template: str | None, system: str | None, sampling: dict) -> None:
    """``generate --chat``: one answer to ``prompt``, or a conversation of the user turns read from stdin."""
    from qharness.runtime.chat import chat_template

    chat_template(program.chat_tokenizer(), template)  # no template, or one that does not render: before any input
    history = [{"role": "system", "content": system}] if system is not None else []
    interactive = prompt is None
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
            line = _read_turn()
            prompt = line.rstrip("\n")
            if not line or not prompt.strip() or prompt.strip() == "/exit":
                return
        program.chat([*history, {"role": "user", "content": prompt}], chat_template=template, **sampling)
        print()
        out = program.last
        if out["dropped"]:
            print(
                f"[dropped the oldest {out['dropped']} turns: the conversation outgrew the .pte's KV cache of "
                f"{out['context']} tokens (the oldest exchanges go first, the system turn stays)]",
                file=sys.stderr,
            )
        _report(out)
        stop = {"eos": "end of turn (or EOS)", "context": "the KV cache is full", "max_new_tokens": "max_new_tokens"}
        print(f"[stopped: {stop[out['stopped']]}]", file=sys.stderr)
        if not interactive:
            return
        history = out["conversation"]


def check_bench_counts(**counts: int | None) -> None:
    """``bench``'s counts, before anything loads: each given one must be a whole number >= 1 (a ``UserError`` naming
    the option; ``--reps 0`` is not "the default")."""
    examples = {"prompt_len": 128, "decode_tokens": 64, "reps": 5, "processes": 5, "threads": 1}
    for name, value in counts.items():
        if value is not None and value < 1:
            fix = f"pass --{name} {examples.get(name, 1)}" + (
                ", or leave it out (free cores)" if name == "threads" else ""
            )
            raise UserError(f"bench --{name} must be >= 1 (got {value})", fix=fix)


def bench(
    *,
    pte: list[str],
    prompt_len: int = 128,
    decode_tokens: int = 64,
    reps: int | None = None,
    processes: int | None = None,
    threads: int | None = None,
    out: str | None = None,
) -> None:
    """Load time, prefill/decode tokens/s, peak RSS and size of a .pte vs the eager FP model (when a summary.json lies
    beside the .pte). Several --pte (or --processes): every program timed in N fresh processes each, in alternating
    rounds (A B, B A, ...), with the spread over processes; added to each summary.json as bench_joint.

    Args:
        pte: a .pte file.
        prompt_len: tokens prefilled in one call.
        decode_tokens: tokens decoded one at a time after the prefill.
        reps: repetitions per process (median and min-max reported; default 5, joint 10).
        processes: fresh processes per program, alternating rounds (default 5 with several --pte).
        threads: ExecuTorch/torch threads in every process (default: the cores free now).
        out: also write the joint result to this JSON file.
    """
    from qharness.io.atomic import write_json_atomic
    from qharness.run.summary import RunSummary

    check_bench_counts(
        prompt_len=prompt_len, decode_tokens=decode_tokens, reps=reps, processes=processes, threads=threads
    )
    if len(pte) > 1 or processes is not None:
        from qharness.runtime.joint import bench_jointly, format_joint, joint_entry
        from qharness.runtime.pte import check_pte_file

        for path in pte:
            check_pte_file(path)
        joint = bench_jointly(
            pte, prompt_len, decode_tokens, 10 if reps is None else reps, 5 if processes is None else processes, threads
        )
        print(format_joint(joint))
        if out:
            write_json_atomic(Path(out), joint)
            print(f"joint result written to {out}")
        for path in pte:
            summary_path = Path(path).parent / "summary.json"
            if summary_path.is_file() and len({Path(x).parent for x in pte}) == len(pte):  # one .pte per run dir
                RunSummary.update(summary_path, bench_joint=joint_entry(joint, path))
                print(f"bench_joint added to {summary_path}")
        return

    from qharness.runtime.bench import bench as run_bench
    from qharness.runtime.bench import format_bench

    summary_path = Path(pte[0]).parent / "summary.json"
    summary = RunSummary.read(summary_path) if summary_path.is_file() else None
    model_dir = None
    if summary is not None:
        # The eager comparison loads the run's model only from this machine (a directory, or the embedded default):
        # a summary.json lying beside a downloaded .pte never makes qharness build, import or download anything.
        if summary.model in ("embedded", "embedded-chat") or Path(summary.model).expanduser().is_dir():
            from qharness.sources.models import resolve_checkpoint

            model_dir = resolve_checkpoint(summary.model)
            _check_eager_model(model_dir, summary_path)
        else:
            print(
                f"eager FP comparison skipped: the model of {summary_path} ({summary.model!r}) is not a local directory",
                file=sys.stderr,
            )
    result = run_bench(pte[0], model_dir, prompt_len, decode_tokens, 5 if reps is None else reps, threads)
    print(format_bench(result))
    if summary is not None:
        RunSummary.update(summary_path, bench=result)
        print(f"bench results added to {summary_path}")


def _check_eager_model(model_dir: str, summary_path: Path) -> None:
    """The eager model a summary.json names loads with transformers' own classes from safetensors: model code of its
    own (``auto_map``) or pickled weights are refused here, in one line, not in the benchmark's child process."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    problem = None
    if isinstance(config, dict) and "auto_map" in config:
        problem = "its config.json maps it to model code of its own (auto_map: remote code)"
    elif not any(Path(model_dir).glob("*.safetensors")):
        problem = "its weights are not safetensors (pickle files such as pytorch_model.bin)"
    if problem:
        raise UserError(
            f"bench's eager FP comparison would load {model_dir}, the model of {summary_path}, but {problem}; "
            "qharness runs no model code and unpickles no weights for it",
            fix="bench the .pte alone (move summary.json out of its directory), or save the model as safetensors "
            "with a transformers class (save_pretrained)",
        )


def profile(
    *,
    pte: list[str],
    prompt_len: int = 128,
    decode_tokens: int = 16,
    reps: int = 3,
    top: int = 25,
    threads: int | None = None,
) -> None:
    """Where each .pte's time goes, operator by operator: one prefill and decode steps under ExecuTorch's event tracer
    (ETDump), summed by event name, every --pte side by side (prefill, then per decode step). XNNPACK kernels are
    marked [xnnpack]; the rest run outside the delegate. Traced times run slower than bench's: compare programs with
    each other here, and time them with bench. The first line says how many threads ran them.

    Args:
        pte: a .pte file (repeat --pte to compare programs).
        prompt_len: tokens prefilled in one call.
        decode_tokens: tokens decoded one at a time after the prefill (the decode table is per step: the median).
        reps: prefill + decode sequences profiled (medians over them), after a warm-up.
        top: rows per table, the costliest first.
        threads: ExecuTorch/torch threads (default: $QHARNESS_THREADS, else the cores free now).
    """
    from qharness.runtime.bench import pte_vocab
    from qharness.runtime.profile import format_profiles, profile_pte

    counts = (("prompt_len", prompt_len), ("decode_tokens", decode_tokens), ("reps", reps), ("top", top))
    for name, value in (*counts, ("threads", 1 if threads is None else threads)):
        if value < 1:
            example = 2 if name == "threads" else 16
            raise UserError(f"profile --{name} must be >= 1 (got {value})", fix=f"e.g. --{name} {example}")
    from qharness.runtime.pte import check_pte_file, runtime_threads, set_runtime_threads

    for path in pte:
        check_pte_file(path)
    names = [Path(path).name for path in pte]
    labels = names if len(set(names)) == len(names) else [str(Path(path).parent) for path in pte]  # a/model.pte, b/...
    if threads is not None:
        set_runtime_threads(threads)
    chosen = "--threads" if threads else "QHARNESS_THREADS" if os.environ.get("QHARNESS_THREADS") else "free cores now"
    print(f"threads: {runtime_threads()} ({chosen})")
    profiles = {}
    for label, path in zip(labels, pte):
        vocab = pte_vocab(path, prompt_len, decode_tokens, 1)
        profiles[label] = profile_pte(path, vocab, prompt_len, decode_tokens, reps)
    print(format_profiles(profiles, "prefill", top))
    print()
    print(format_profiles(profiles, "decode", top))


def report(
    runs_dir: str,
    *,
    out: str | None = None,
    metric: str = "ppl",
    max_latency_ms: float | None = None,
    max_size_mb: float | None = None,
    no_wandb: bool = False,
) -> None:
    """Accuracy vs latency over the runs under RUNS_DIR: table (report.md/.csv), Pareto plots (pareto.png; by .pte size:
    pareto_size.png), best run under
    a budget, ties called ties; logged to wandb.

    Args:
        runs_dir: directory searched (recursively) for summary.json files.
        out: where report.md/.csv/.json and pareto.png go (default: RUNS_DIR).
        metric: accuracy axis: ppl (the .pte's validation perplexity), TASK/METRIC (the .pte's lm-eval metric, e.g.
            hellaswag/acc), TASK/METRIC/STAGE, or a column of report.csv.
        max_latency_ms: latency budget: decode ms/token of the .pte.
        max_size_mb: size budget: .pte MB (1 MB = 1e6 bytes).
        no_wandb: do not log the report to wandb.
    """
    from qharness.api.jobs import report as write_report

    result = write_report(
        runs_dir, out=out, metric=metric, max_latency_ms=max_latency_ms, max_size_mb=max_size_mb, wandb=not no_wandb
    )
    print(result["text"])
    print(f"table: {result['paths']['markdown']} and {result['paths']['csv']}")
    print(f"Pareto plot: {result['paths']['png']}")
    print(f"Pareto plot by .pte size: {result['paths']['size_png']}")
    if result["wandb_dir"]:
        print(f"wandb run: {result['wandb_dir']}")


def sweep(config: str, *, force: bool = False, dry_run: bool = False, jobs: int | None = None) -> None:
    """Run the FP baseline and recipes x modes (PTQ, QAT) of a sweep config, each in its own run dir (finished runs are
    skipped), time every .pte jointly, then write the report.

    Args:
        config: sweep YAML, e.g. configs/sweep_xnnpack.yaml.
        force: rerun runs that already finished.
        dry_run: print the runs and whether each would be skipped; run nothing.
        jobs: runs at a time, each with its share of the cores (default: the config's jobs, else 1); their output then
            goes to each run's sweep.log.
    """
    from qharness.api.jobs import sweep as run_sweep
    from qharness.progress import format_seconds

    result = run_sweep(config, force=force, dry_run=dry_run, jobs=jobs)
    if dry_run:
        for run in result["runs"]:
            skipped = "(finished: skipped)" if run["state"] == "finished" else ""
            print(f"{run['name']:<32} qharness {run['subcommand']} {run['config']}  {skipped}")
        return
    rep = result["report"]
    print()
    if rep is not None:
        print(rep["text"])
    done = sum(r["state"] != "failed" for r in result["runs"])
    print(
        f"\nsweep: {done}/{len(result['runs'])} runs finished in {format_seconds(result['wall_s'])}"
        + (
            f"; failed: {', '.join(r['name'] for r in result['runs'] if r['state'] == 'failed')}"
            if done < len(result["runs"])
            else ""
        )
    )
    if rep is not None:
        print(f"table: {rep['paths']['markdown']} and {rep['paths']['csv']}")
        print(f"Pareto plot: {rep['paths']['png']}")
        print(f"Pareto plot by .pte size: {rep['paths']['size_png']}")
    if done < len(result["runs"]):
        raise SystemExit(1)


def ship(
    config: str,
    *,
    max_ppl_increase: str,
    max_size_mb: float | None = None,
    max_latency_ms: float | None = None,
    prefer: str = "size",
    jobs: int | None = None,
    exclude: list[str] | None = None,
) -> None:
    """Which recipe to ship: climb the ladder (int8 PTQ -> 4-bit PTQ -> per-layer mixed -> QAT -> fewer bits) until
    the smallest (or fastest) candidate meets the tolerance; writes ship.json/.md, chosen.pte and chosen.yaml. Exits 1
    when no candidate meets the goal (the record names the closest).

    Args:
        config: ship YAML, e.g. configs/ship_xnnpack.yaml.
        max_ppl_increase: the tolerance, e.g. 2%: the .pte's perplexity against FP, upper end of the paired 95%
            interval.
        max_size_mb: .pte size budget (MB).
        max_latency_ms: decode latency budget (ms/token, median of the joint benchmark).
        prefer: size (the smallest candidate that meets everything) or latency (the fastest).
        jobs: candidates at a time (default: the config's jobs).
        exclude: a recipe of the ladder to leave out, e.g. xnnpack_8da4w_rot_gptq (a runtime without rotations).
    """
    from qharness.api.ship import ship as run_ship
    from qharness.progress import format_seconds

    rec = run_ship(
        config,
        max_ppl_increase,
        max_size_mb=max_size_mb,
        max_latency_ms=max_latency_ms,
        prefer=prefer,
        jobs=jobs,
        exclude=exclude or (),
    )
    print()
    print(f"ship: {rec.outcome}: {rec.decision}")
    print(f"stopped: {rec.stop_reason}")
    if rec.chosen:
        print(f"ship {rec.chosen_pte} (recipe {rec.chosen_recipe}; re-run: {rec.rerun})")
    print(
        f"decision record: {rec.ship_dir}/ship.json and ship.md; this ship {format_seconds(rec.wall_s)}, "
        f"the runs' own time {format_seconds(rec.candidates_wall_s)}"
    )
    if rec.outcome != "chosen":
        raise SystemExit(1)  # no candidate meets the goal: a script can tell
