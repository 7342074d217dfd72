"""Weights & Biases logging of every run: offline by default, online once you have logged in.

Every ``fit|calibrate|export|validate|test`` logs through Lightning's ``WandbLogger`` into
``<run dir>/wandb/`` (beside Lightning's CSV logs): the run's config, the train/val curves and, after the
``.pte`` is checked and benchmarked, one final row (``qharness.reporting.rows.summary_row``: model, recipe, mode,
FP / fake-quant / ``.pte`` perplexities with their 95% intervals (``ppl_<model>_lo``/``_hi``) and the ``.pte``'s
paired ratio to FP (``ppl_pte_vs_fp`` and its ``_lo``/``_hi``), lm-eval metrics with their standard errors
(``eval/<task>/<metric>_stderr/<model>``), parity figures, ``.pte`` size, prefill/decode tokens/s with their
ranges, bandwidth fraction) as the table ``final_row`` and in the run summary. Offline runs upload later with
``wandb sync <run dir>/wandb/offline-run-*``. ``qharness report`` logs its table, scatter chart and Pareto plot in
one run of its own (``log_to_wandb``).

Example::

    logger = make_wandb_logger("runs/x", WandbConfig(), name="xnnpack_int8_dynamic-qat", config={"model": {...}})
    log_final_row([logger], summary)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import urlsplit

from qharness.config import WandbConfig
from qharness.errors import UserError
from qharness.run.summary import RunSummary

log = logging.getLogger(__name__)

TABLE_KEY = "final_row"


def wandb_logged_in(env=os.environ) -> bool:
    """Whether wandb has credentials: ``WANDB_API_KEY``, or a netrc entry for the W&B host (what ``wandb login`` writes)."""
    if env.get("WANDB_API_KEY"):
        return True
    import netrc

    host = urlsplit(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return bool(host) and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(requested: str | None = None, env=os.environ) -> str:
    """``requested`` (``wandb.mode``), else ``WANDB_MODE``, else online when logged in, else offline."""
    mode = requested or env.get("WANDB_MODE") or ("online" if wandb_logged_in(env) else "offline")
    if mode not in ("online", "offline", "disabled", "dryrun", "run"):
        raise UserError(
            f"wandb mode {mode!r} is not one of online, offline, disabled",
            fix="set wandb.mode or WANDB_MODE to online or offline",
        )
    return mode


def use_wandb_mode(requested: str | None = None) -> str:
    """Set ``WANDB_MODE`` for this process (and the ones it starts) and return it."""
    mode = wandb_mode(requested)
    os.environ["WANDB_MODE"] = mode
    return mode


def make_wandb_logger(
    run_dir: str | os.PathLike, cfg: WandbConfig, name: str, config: dict, job_type: str | None = None
):
    """A ``WandbLogger`` writing into ``<run_dir>/wandb`` (the run starts lazily, on first use)."""
    from lightning.pytorch.loggers import WandbLogger

    use_wandb_mode(cfg.mode)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(
        name=cfg.name or name,
        save_dir=str(run_dir),
        project=cfg.project,
        group=cfg.group,
        job_type=job_type,
        tags=list(cfg.tags),
        config=config,
    )


def run_config(
    cfg: dict, groups=("model", "data", "trainer", "deploy", "parity", "calibration", "bench", "checkpoint")
) -> dict:
    """The JSON-safe part of a run's config (scalars and lists of scalars) for ``wandb.init(config=...)``."""

    def plain(v):
        return (
            v is None
            or isinstance(v, (bool, int, float, str))
            or (isinstance(v, (list, tuple)) and all(plain(x) for x in v))
        )

    out = {g: {k: v for k, v in (cfg.get(g) or {}).items() if plain(v)} for g in groups if isinstance(cfg.get(g), dict)}
    for k in ("seed_everything", "ckpt_path"):
        if plain(cfg.get(k)):
            out[k] = cfg.get(k)
    return out


def log_final_row(loggers, summary: RunSummary) -> dict | None:
    """Log the run's final row (``summary_row(summary)``) to every ``WandbLogger`` in ``loggers``, then finish
    its wandb run so the offline files are complete. Returns the row (None: no WandbLogger)."""
    from lightning.pytorch.loggers import WandbLogger

    from qharness.reporting.rows import summary_row

    wandb_loggers = [lg for lg in loggers if isinstance(lg, WandbLogger)]
    if not wandb_loggers:
        return None
    row = summary_row(summary)
    for lg in wandb_loggers:
        try:
            lg.log_table(TABLE_KEY, columns=list(row), data=[list(row.values())])
            run = lg.experiment
            run.summary.update({f"final/{k}": v for k, v in row.items() if v is not None})
            run.finish()
        except Exception as e:  # the .pte and summary.json are written: a logging failure must not fail the run
            log.warning("could not log the final row to wandb (%s: %s); summary.json has it", type(e).__name__, e)
    return row


def log_to_wandb(
    rows: list[dict], columns: list[str], column: str, png: Path, out_dir: Path, name: str, project: str = "qharness"
) -> Path | None:
    """The table, a scatter chart (metric vs decode ms/token) and the PNG in one wandb run under ``out_dir/wandb``."""
    if use_wandb_mode() == "disabled":
        return None
    import wandb

    run = wandb.init(
        project=project,
        dir=str(out_dir),
        name=f"report-{name}",
        job_type="report",
        group=name,
        config={"metric": column, "runs": len(rows)},
    )
    table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
    run.log(
        {
            "report/table": table,
            "report/scatter": wandb.plot.scatter(
                table, "decode_ms_per_token", column, title=f"{column} vs decode ms/token"
            ),
            "report/pareto": wandb.Image(str(png)),
        }
    )
    run_dir = Path(run.dir).parent
    run.finish()
    return run_dir
