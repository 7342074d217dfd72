"""lm-eval over the models of a run: FP, fake-quant, converted, ``.pte``; one table, saved as ``eval.json``.

Example::

    lms = {"fp": QHarnessLM(hf_backend(fp_model, 128), tok), "pte": QHarnessLM(pte_backend("runs/x/model.pte", 128), tok)}
    result = run_eval(lms, EvalConfig(limit=16), texts=heldout_texts(dm), run_dir=Path("runs/x"))
    print(format_eval_table(result))
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from qharness.checks.stats import is_stderr, stderr_name
from qharness.config import MODEL_KINDS, EvalConfig, check_answer_length, check_eval_lengths
from qharness.errors import UserError
from qharness.io.atomic import to_jsonable, write_json_atomic

log = logging.getLogger(__name__)


def check_eval_config(cfg: EvalConfig, seq_len: int, max_seq_len: int) -> None:
    """``eval.*`` against the rest of the run (lengths, paths, task names and their data), before any long work;
    each field alone was checked when ``EvalConfig`` was built."""
    from qharness.evaluation.tasks import check_tasks

    check_eval_lengths(max_length(cfg, seq_len), seq_len, max_seq_len)
    check_tasks(cfg.tasks, cfg.include_path)
    if cfg.source is not None:  # read now, not after training: a bad or too small text fails before any long work
        check_eval_text(cfg, None)


def _where(cfg: EvalConfig) -> str:
    return f"eval.source {cfg.source}" if cfg.source is not None else "the run's validation text, from data.source"


def check_eval_text(cfg: EvalConfig, dm) -> None:
    """The evaluation text gives each offline task among ``cfg.tasks`` its documents (``tasks.offline_documents``);
    ``dm`` (set up) gives the validation text when ``eval.source`` is null. Run before training."""
    from qharness.evaluation.tasks import OFFLINE_TASKS, offline_documents

    if any(t in OFFLINE_TASKS for t in cfg.tasks):
        offline_documents(eval_texts(cfg, dm), cfg.tasks, _where(cfg), cfg.seed)


def check_chat_eval(cfg: EvalConfig, dm) -> None:
    """``eval.chat_template`` on has a template to render with (the run's ``data.chat_template`` or the tokenizer's),
    and ``eval.answers.source`` holds chat records; ``dm`` set up. Run before training."""
    chat_data = dm.format is not None
    if cfg.uses_chat_template(chat_data) and not (chat_data and dm.format.template is not None):
        if not getattr(dm.load_tokenizer(), "chat_template", None):
            raise UserError(
                "eval.chat_template is on but the run has no chat template (plain-text data, and the tokenizer has none)",
                fix="set eval.chat_template: false (or auto), or train on chat data with data.chat_template",
            )
    if cfg.answers.enabled and (chat_data or cfg.answers.source is not None):
        check_answer_length(cfg.answers.max_new_tokens, max_length(cfg, dm.seq_len))
        if cfg.answers.source is not None:
            dm.conversations(cfg.answers.source, 1)


def max_length(cfg: EvalConfig, seq_len: int) -> int:
    return cfg.max_length or seq_len


def heldout_texts(dm) -> list[str]:
    """The run's validation text (the end of the token stream that training never saw), as documents."""
    stream = dm.val_tokens.tolist()  # the inputs and the last target, unmasked (chat data masks targets)
    eos = dm.tokenizer.eos_token_id
    docs, cur = [], []
    for t in stream:
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    docs.append(cur)
    return [text for text in dm.tokenizer.batch_decode([d for d in docs if d]) if text.strip()]


def eval_texts(cfg: EvalConfig, dm) -> list[str]:
    if cfg.source is None:
        return heldout_texts(dm)
    from qharness.sources.text import load_texts

    return load_texts(cfg.source, cfg.text_field, field="eval.source")


def _clean(metrics: dict) -> dict:
    """``{"acc,none": np.float64(0.5), "acc_stderr,none": "N/A", "alias": ...}`` -> ``{"acc": 0.5, "acc_stderr": None}``."""
    out = {}
    for key, value in metrics.items():
        if key in ("alias", "name", "sample_len"):
            continue
        name = key[: -len(",none")] if key.endswith(",none") else key
        value = to_jsonable(value)
        out[name] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return out


def format_value(v: float | None, se: float | None = None) -> str:
    """``0.4500 ± 0.0100`` (``-`` when missing; no ``±`` without a standard error)."""
    if v is None:
        return "-"
    text = f"{v:.4g}" if abs(v) >= 1 else f"{v:.4f}"
    return text if se is None else text + (f" ± {se:.4g}" if abs(se) >= 1 else f" ± {se:.4f}")


# A model that knows nothing about the text: uniform over the 256 byte values.
UNIFORM_BYTES = {"byte_perplexity": 256.0, "bits_per_byte": 8.0}


def chance_levels(task_names: list[str], manager, limit: int | None) -> dict[str, dict[str, float]]:
    """What guessing scores, per task and metric, on the documents evaluated: multiple choice
    ``mean(1 / number of choices)`` (acc, acc_norm, acc_mutual_info); rolling perplexity a uniform byte model
    (byte_perplexity 256, bits_per_byte 8). Generation and word perplexity have no chance level (absent).

    Example: ``chance_levels(["qharness_mc"], manager, 32)`` -> ``{"qharness_mc": {"acc_mutual_info": 0.25}}``
    """
    from lm_eval.tasks import get_task_dict

    def tasks(d):
        for name, task in d.items():
            if isinstance(task, dict):
                yield from tasks(task)
            else:
                yield getattr(name, "group_name", None) or str(task.config.task), task

    out = {}
    for name, task in tasks(get_task_dict(list(task_names), manager)):
        if task.OUTPUT_TYPE == "multiple_choice":
            docs = [doc for _, doc in task.doc_iterator(limit=limit)]
            metrics = [m["metric"] for m in task.config.metric_list or [{"metric": "acc"}, {"metric": "acc_norm"}]]
            if docs:
                p = sum(1 / len(task.doc_to_choice(doc)) for doc in docs) / len(docs)
                out[name] = {m: p for m in metrics if m in ("acc", "acc_norm", "acc_mutual_info")}
        elif task.OUTPUT_TYPE == "loglikelihood_rolling":
            out[name] = dict(UNIFORM_BYTES)
    return out


def run_eval(
    lms: dict, cfg: EvalConfig, texts: list[str], run_dir: Path, extra: dict | None = None, filename: str = "eval.json"
) -> dict:
    """Evaluate each model (``{kind: QHarnessLM}``) on ``cfg.tasks``; write ``run_dir/<filename>``.

    The offline tasks are written (YAML + JSONL) to ``run_dir/eval/tasks``, which also works as an
    ``--include_path`` for the ``lm_eval`` command. lm-eval's own task index (≈ 20 s) is built only when
    a standard task is asked for.
    """
    import lm_eval
    from datasets.utils.logging import disable_progress_bar
    from lm_eval.tasks import TaskManager

    from qharness.evaluation.tasks import OFFLINE_TASKS, scan_task_names, write_offline_tasks

    disable_progress_bar()  # "Generating test split" bars for every task and model
    run_dir = Path(run_dir)
    include = (
        [str(write_offline_tasks(texts, run_dir / "eval" / "tasks", cfg.seed, cfg.tasks, _where(cfg)))]
        if any(t in OFFLINE_TASKS for t in cfg.tasks)
        else []
    )
    if cfg.include_path:
        include.append(cfg.include_path)
    own = scan_task_names(cfg.include_path) if cfg.include_path else {}
    standard = any(t not in OFFLINE_TASKS and t not in own for t in cfg.tasks)
    manager = TaskManager(include_path=include or None, include_defaults=standard, verbosity="ERROR")
    result = {
        "tasks": {},
        "models": list(lms),
        "limit": cfg.limit,
        "num_fewshot": cfg.num_fewshot,
        "seconds": {},
        **(extra or {}),
    }
    chat = {}  # lm-eval's chat-template settings: only where the models carry a template (plain runs unchanged)
    if any(getattr(lm, "template", None) is not None for lm in lms.values()):
        chat = {
            "apply_chat_template": True,
            "system_instruction": cfg.system_instruction,
            "fewshot_as_multiturn": cfg.fewshot_as_multiturn,
        }
        result["chat_template"] = {
            "system_instruction": cfg.system_instruction,
            "fewshot_as_multiturn": cfg.fewshot_as_multiturn,
        }
    for kind, lm in lms.items():
        log.info("lm-eval: %s on %s ...", MODEL_KINDS[kind], ", ".join(cfg.tasks))
        t = time.perf_counter()
        res = lm_eval.simple_evaluate(
            **chat,
            model=lm,
            tasks=list(cfg.tasks),
            num_fewshot=cfg.num_fewshot,
            limit=cfg.limit,
            task_manager=manager,
            bootstrap_iters=cfg.bootstrap_iters,
            log_samples=False,
            random_seed=cfg.seed,
            numpy_random_seed=cfg.seed,
            torch_random_seed=cfg.seed,
            fewshot_random_seed=cfg.seed,
            verbosity="ERROR",
        )
        result["seconds"][kind] = time.perf_counter() - t
        for task, metrics in res["results"].items():
            result["tasks"].setdefault(task, {})[kind] = _clean(metrics)
        for task, n in res.get("n-samples", {}).items():
            result.setdefault("documents", {})[task] = int(n.get("effective", 0))
    result["chance"] = chance_levels(cfg.tasks, manager, cfg.limit)
    write_json_atomic(run_dir / filename, result)
    return result


def evaluate_models(
    backends: dict,
    tokenizer,
    cfg: EvalConfig,
    texts: list[str],
    run_dir: Path,
    extra: dict | None = None,
    filename: str = "eval.json",
    chat_template: str | None = None,
) -> dict:
    """Run ``cfg.models`` among the available ``backends`` (``{kind: () -> backend}``, built lazily); with a
    ``chat_template`` (``eval.chat_template`` on), lm-eval renders its prompts with it.

    A PTQ run has no trained fake-quant graph: the converted model (the quantized PyTorch reference)
    stands in for it. Models that cannot run here (e.g. a Vulkan ``.pte``) are skipped with a warning.
    """
    from qharness.evaluation.lm_eval_adapter import QHarnessLM

    lms = {}
    for kind in cfg.models:
        if kind == "fake_quant" and kind not in backends and "converted" in backends and "converted" not in cfg.models:
            log.info("eval: no trained fake-quant graph (PTQ); the converted model stands in for it")
            kind = "converted"
        if kind not in backends:
            log.warning("eval: %s is not available in this run; skipped", MODEL_KINDS[kind])
            continue
        lms[kind] = QHarnessLM(backends[kind](), tokenizer, seed=cfg.seed, chat_template=chat_template)
    if not lms:
        raise UserError(
            f"eval.models={cfg.models}: none of them is available in this run",
            fix=f"choose among {', '.join(backends)}",
        )
    return run_eval(lms, cfg, texts, run_dir, extra, filename)


def format_eval_table(result: dict) -> str:
    """Task x metric rows: the chance level (``-``: none), then one column per model: value ± lm-eval's
    standard error (where lm-eval gives one)."""
    kinds = result["models"]
    chance = result.get("chance") or {}
    rows = [("task", "metric", "chance", *(MODEL_KINDS[k] for k in kinds))]
    for task, per_model in result["tasks"].items():
        names = [m for m in next(iter(per_model.values())) if not is_stderr(m)]
        for i, metric in enumerate(names):
            cells = [
                format_value(per_model.get(k, {}).get(metric), per_model.get(k, {}).get(stderr_name(metric)))
                for k in kinds
            ]
            rows.append((task if i == 0 else "", metric, format_value(chance.get(task, {}).get(metric)), *cells))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    docs = result.get("documents", {})
    head = f"lm-eval ({', '.join(f'{t}: {n} docs' for t, n in docs.items()) or 'no tasks'}; {result.get('max_length', '?')}-token window)"
    return "\n".join([head, *("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows)])
