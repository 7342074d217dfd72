"""``--metric`` -> the table column it names and its direction; a metric no run will have found before the runs."""

from __future__ import annotations

import re

from qharness.checks.stats import is_stderr, stderr_name
from qharness.errors import UserError
from qharness.reporting.rows import STAGES, row_columns

LOWER_IS_BETTER = re.compile(r"(ppl|perplexity|loss|bits_per_byte|bpb|error|latency|_ms|size|rss|diff)", re.IGNORECASE)


def resolve_metric(metric: str, rows: list[dict]) -> tuple[str, bool]:
    """``--metric`` -> (table column, lower is better). ``ppl`` is the ``.pte``'s validation perplexity;
    ``TASK/METRIC`` the ``.pte``'s lm-eval metric (``TASK/METRIC/STAGE`` another stage's); any column name works."""
    columns = {c for r in rows for c in r}
    if metric == "ppl":
        column = "ppl_pte"
    elif metric in columns:
        column = metric
    else:
        parts = metric.removeprefix("eval/").split("/")
        column = "eval/" + "/".join(parts + ["pte"] if len(parts) == 2 else parts)
        if column not in columns:
            known = sorted(
                {
                    "/".join(c.split("/")[1:3])
                    for c in columns
                    if c.startswith("eval/") and not is_stderr(c.split("/")[2])
                }
            )
            raise UserError(
                f"metric {metric!r} is in none of the summaries",
                fix="use ppl, a column of the table"
                + (f", or a task metric: {', '.join(known)}" if known else " (no run has lm-eval results)"),
            )
    return column, bool(LOWER_IS_BETTER.search(column.split("/")[-2] if column.startswith("eval/") else column))


def check_metric(metric, tasks: list[str], where: str = "report.metric") -> None:
    """A ``--metric`` that no run will have, found before the runs (a sweep's ``report.metric``): ``ppl``, a column
    every run's row has, or ``TASK/METRIC[/STAGE]`` of a task in ``tasks`` (the lm-eval tasks the runs evaluate;
    the metric itself is checked for qharness's offline tasks, whose metrics are known beforehand)."""
    from qharness.evaluation.tasks import offline_metrics

    fixed = row_columns()
    if isinstance(metric, str) and (metric == "ppl" or (metric in fixed and not metric.startswith("_"))):
        return
    parts = metric.removeprefix("eval/").split("/") if isinstance(metric, str) else []
    task, name, stage = (parts + ["pte"])[:3] if len(parts) in (2, 3) else (None, None, None)
    known = offline_metrics().get(task)
    why = (
        "not a metric name"
        if task is None or not name or stage not in STAGES
        else f"no run evaluates task {task!r} (eval.tasks: {', '.join(tasks) or 'none, eval disabled'})"
        if task not in tasks
        else f"task {task} has no metric {name!r} (it has {', '.join(sorted(known))})"
        if known is not None and name not in known and not (is_stderr(name) and name in {stderr_name(k) for k in known})
        else None
    )
    if why is not None:
        example = (
            f" or TASK/METRIC such as {tasks[0]}/{sorted(offline_metrics().get(tasks[0], ['acc']))[0]}" if tasks else ""
        )
        raise UserError(f"{where} {metric!r}: {why}", fix=f"use ppl, a column of the report table{example}")
