"""lm-eval tasks: the offline tasks qharness ships, and early checks of task names and their data.

The offline tasks (``qharness/evaluation/lm_eval_tasks/*.yaml``) read JSONL documents that ``write_offline_tasks``
builds from any text (the run's held-out validation text, or a local file):

* ``qharness_ppl``: rolling perplexity of documents (word/byte perplexity, bits per byte), like wikitext;
* ``qharness_mc``: which of four lines follows a context (acc, acc_norm), like hellaswag;
* ``qharness_gen``: continue a context to the end of the line (exact match, chrF).

Standard lm-eval tasks (wikitext, hellaswag, arc_easy, ...) are checked by name against lm-eval's task
files (a ~0.5 s scan, no 20 s index build), and their hub data for reachability, so a bad name or an
offline machine fails in seconds.

Example::

    task_dir = write_offline_tasks(["text ..."], Path("runs/x/eval/tasks"))
    check_tasks(["qharness_ppl", "hellaswag"])      # UserError offline: hellaswag's data cannot be reached
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import os
import random
import re
import socket
from pathlib import Path

import yaml

from qharness.errors import UserError
from qharness.io.atomic import atomic_dir, write_text_atomic
from qharness.io.yaml_reader import check_yaml_file

OFFLINE_TASKS = ("qharness_ppl", "qharness_mc", "qharness_gen")
TEMPLATES = Path(__file__).parent / "lm_eval_tasks"


def _chunks(text: str, max_chars: int) -> list[str]:
    """Consecutive pieces of at most ``max_chars``, cut at line ends."""
    pieces, cur = [], ""
    for line in text.splitlines(keepends=True):
        if cur and len(cur) + len(line) > max_chars:
            pieces.append(cur)
            cur = ""
        cur += line[:max_chars]
    return pieces + ([cur] if cur else [])


def _good_line(line: str) -> bool:
    return 16 <= len(line.strip()) <= 120


LONG_LINE = 400  # characters: a longer line (a whole paragraph or document on one line) is wrapped into pieces
WRAP = 100  # characters per piece of a wrapped line


def _wrap_long_lines(text: str) -> str:
    """``text`` with each line over ``LONG_LINE`` characters wrapped at spaces into lines of at most ``WRAP``:
    documents stored one per line (JSONL, parquet rows) then give the offline tasks usable lines, as prose does."""
    if len(text) <= LONG_LINE or all(len(line) <= LONG_LINE for line in text.split("\n")):
        return text
    import textwrap

    out = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        if len(body) <= LONG_LINE:
            out.append(line)
            continue
        out.append("\n".join(textwrap.wrap(body, WRAP, break_on_hyphens=False)) + (line[len(body) :] or "\n"))
    return "".join(out)


def build_documents(
    texts: list[str], seed: int = 1234, max_docs: int = 256, doc_chars: int = 2000, context_chars: int = 400
) -> dict[str, list[dict]]:
    """Documents for the three offline tasks from plain texts (deterministic for a seed).

    Returns ``{"qharness_ppl": [{"text"}], "qharness_mc": [{"context", "choices", "label"}],
    "qharness_gen": [{"context", "target"}]}``.
    """
    rng = random.Random(seed)
    texts = [_wrap_long_lines(t) for t in texts]
    ppl = [p for t in texts for p in _chunks(t, doc_chars) if len(p.strip()) >= 100]
    rng.shuffle(ppl)
    by_indent: dict[str, list[str]] = {}
    sites = []  # (context, next line)
    for t in texts:
        lines = t.splitlines(keepends=True)
        before = ""
        for line in lines:
            body = line.rstrip("\n")
            if _good_line(body):
                by_indent.setdefault(body[: len(body) - len(body.lstrip())], []).append(body)
                if len(before) >= 64:
                    context = before[-context_chars:]
                    context = context[context.find("\n") + 1 :] if "\n" in context[:-1] else context
                    sites.append((context, body))
            before = (before + line)[-4 * context_chars :]
    rng.shuffle(sites)
    mc, gen = [], []
    for context, body in sites:
        indent = body[: len(body) - len(body.lstrip())]
        pool = sorted(set(by_indent.get(indent, [])) - {body})
        if len(mc) < max_docs and len(pool) >= 3:
            choices = rng.sample(pool, 3)
            label = rng.randrange(4)
            choices.insert(label, body)
            mc.append({"context": context, "choices": choices, "label": label})
        elif len(gen) < max_docs:
            gen.append({"context": context, "target": body})
        if len(mc) >= max_docs and len(gen) >= max_docs:
            break
    return {"qharness_ppl": [{"text": p} for p in ppl[:max_docs]], "qharness_mc": mc, "qharness_gen": gen}


# What each offline task needs from the evaluation text (said when the text has none of it).
NEEDS = {
    "qharness_ppl": "documents of at least 100 characters",
    "qharness_mc": "lines of 16-120 characters after 64 characters of context, with 3 more lines of the same indent",
    "qharness_gen": "lines of 16-120 characters after 64 characters of context",
}


def offline_documents(texts: list[str], tasks, where: str, seed: int = 1234) -> dict[str, list[dict]]:
    """``build_documents`` for the offline tasks among ``tasks``; ``UserError`` when the text (``where``: the
    setting it came from) gives one of them no document. Run before training and again when the tasks are written."""
    wanted = [t for t in tasks if t in OFFLINE_TASKS]
    docs = build_documents(texts, seed) if wanted else {}
    for name in wanted:
        if not docs[name]:
            raise UserError(
                f"the evaluation text ({where}, {len(texts)} documents, {sum(map(len, texts)):,} characters) gives "
                f"{name} no documents: it needs {NEEDS[name]}",
                fix=f"give eval.source more text of that kind, or drop {name} from eval.tasks",
            )
    return docs


def write_offline_tasks(
    texts: list[str], out_dir: Path, seed: int = 1234, tasks=OFFLINE_TASKS, where: str = "eval.source"
) -> Path:
    """Write the YAMLs and JSONL documents of the offline tasks among ``tasks`` as ``out_dir`` (an lm-eval include
    path): a directory made afresh for this evaluation that replaces whatever was there (``atomic_dir``), so a YAML
    planted in a run's ``eval/tasks`` (a ``task: qharness_ppl`` with a ``!function``) is gone before lm-eval reads
    the folder: only qharness's own task files and the user's ``eval.include_path`` are ever loaded."""
    out_dir = Path(out_dir)
    docs = offline_documents(texts, tasks, where, seed)
    final = out_dir.resolve()  # where the files are once the directory is in place (the YAMLs name their data)
    with atomic_dir(out_dir) as fresh:
        for name, rows in docs.items():
            if name not in tasks:
                continue
            write_text_atomic(fresh / "data" / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
            cfg = yaml.safe_load((TEMPLATES / f"{name}.yaml").read_text())
            cfg["dataset_kwargs"]["data_files"]["test"] = str(final / "data" / f"{name}.jsonl")
            write_text_atomic(fresh / f"{name}.yaml", yaml.safe_dump(cfg, sort_keys=False))
    return out_dir


@functools.lru_cache(maxsize=None)
def offline_metrics() -> dict[str, set[str]]:
    """The metrics each offline task reports (its template's ``metric_list``), e.g. ``{"qharness_mc": {"acc_mutual_info"}}``."""
    out = {}
    for name in OFFLINE_TASKS:
        cfg = yaml.safe_load((TEMPLATES / f"{name}.yaml").read_text())
        out[name] = {m["metric"] for m in cfg.get("metric_list") or []}
    return out


# ---- names and data of standard lm-eval tasks -------------------------------------------------------

_NAME = re.compile(rb"^(?:task|group|tag):[ \t]*(.*)$((?:\n[ \t]+-.*)*)", re.M)


def task_files(root: str) -> list[str]:
    """The YAML files under ``root``, as lm-eval's ``TaskManager`` finds them."""
    return [
        os.path.join(dirpath, f)
        for dirpath, _dirs, files in os.walk(root)
        for f in sorted(files)
        if f.endswith((".yaml", ".yml"))
    ]


def scan_task_names(root: str) -> dict[str, str]:
    """Task, group and tag names declared in the YAML files under ``root`` -> the file declaring each."""
    names: dict[str, str] = {}
    for path in task_files(root):
        with open(path, "rb") as fh:
            data = fh.read()
        for m in _NAME.finditer(data):
            first, rest = m.group(1).strip(), m.group(2)
            values = first.strip(b"[]").split(b",") if first.startswith(b"[") else [first]
            values += [line.strip()[1:] for line in rest.split(b"\n") if line.strip()]
            for v in values:
                v = v.strip().strip(b"'\"").decode(errors="ignore")
                if v:
                    names.setdefault(v, path)
    return names


@functools.lru_cache(maxsize=None)
def standard_task_index() -> dict[str, str]:
    """Every task/group/tag name in lm-eval's bundled task files -> its YAML."""
    spec = importlib.util.find_spec("lm_eval")
    return scan_task_names(os.path.join(spec.submodule_search_locations[0], "tasks"))


def _lenient_yaml(path: str) -> dict:
    loader = type("Lenient", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        return yaml.load(Path(path).read_text(), Loader=loader) or {}
    except yaml.YAMLError:
        return {}


def _dataset_of(path: str) -> tuple[str | None, str | None]:
    """(dataset_path, dataset_name) of a task YAML, following ``include:``."""
    cfg = _lenient_yaml(path)
    if "dataset_path" not in cfg and isinstance(cfg.get("include"), str):
        base_path, base_name = _dataset_of(str(Path(path).parent / cfg["include"]))
        return base_path, cfg.get("dataset_name", base_name)
    return cfg.get("dataset_path"), cfg.get("dataset_name")


def _truthy(var: str) -> bool:
    return os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached (None: it can)."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if _truthy(var):
            return f"{var}=1"
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as e:
        return f"no network: {e}"
    return None


def _cached_locally(dataset_path: str) -> bool:
    """Whether the hub dataset lies in the local Hugging Face cache (then lm-eval can load it offline)."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:  # pragma: no cover - huggingface_hub comes with datasets
        return False
    return (Path(HF_HUB_CACHE) / f"datasets--{dataset_path.replace('/', '--')}").is_dir()


def check_tasks(names: list[str], include_path: str | None = None) -> None:
    """Fail early (UserError) on an unknown task name, or a standard task whose data cannot be reached."""
    if not names:
        raise UserError("eval.tasks is empty", fix=f"name at least one task, e.g. {', '.join(OFFLINE_TASKS)}")
    if include_path and not Path(include_path).is_dir():
        raise UserError(f"eval.include_path {include_path} is not a directory")
    own = {}
    if include_path:
        for path in task_files(include_path):  # lm-eval's loader bounds nothing: an alias bomb would hang it
            check_yaml_file(path, "eval.include_path task")
        own = scan_task_names(include_path)
    offline_fix = (
        f"use the offline tasks {', '.join(OFFLINE_TASKS)} (built from the run's data, or eval.source: a local text file), "
        "run once with network access so the dataset lands in the Hugging Face cache, "
        "or point eval.include_path at task YAMLs that read local files"
    )
    for name in names:
        if name in OFFLINE_TASKS or name in own:
            continue
        index = standard_task_index()
        if name not in index:
            close = difflib.get_close_matches(name, [*OFFLINE_TASKS, *own, *index], n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(
                f"eval.tasks: unknown lm-eval task {name!r}{hint}",
                fix=f"use {', '.join(OFFLINE_TASKS)} or a task name from `lm_eval ls tasks`",
            )
        dataset_path, dataset_name = _dataset_of(index[name])
        if dataset_path is not None and (Path(dataset_path).exists() or _cached_locally(dataset_path)):
            continue
        why = _hub_unreachable()
        if why is not None:
            what = (
                f"dataset {dataset_path}" + (f" ({dataset_name})" if dataset_name else "")
                if dataset_path
                else "its datasets"
            )
            raise UserError(
                f"lm-eval task {name!r} needs {what} from the Hugging Face hub, which cannot be reached ({why})",
                fix=offline_fix,
            )
