"""The decision record of ``qharness ship``: ``ship.json`` (``ShipRecord``: each rung tried or skipped and why,
each candidate's accuracy with its interval, size, latency, verdict and wall time, the outcome) and ``ship.md``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qharness.io.atomic import write_bytes_atomic, write_json_atomic
from qharness.progress import format_seconds

SHIP_JSON, SHIP_MD = "ship.json", "ship.md"


@dataclass
class CandidateRecord:
    """One candidate ``.pte``: its run, rung, how it got here (``state``: ``ran`` now, ``reused`` from an earlier
    ship or sweep of the same config, ``failed``), its perplexity against FP with the paired 95% interval, its size,
    decode latency (joint benchmark median), parity verdict, the wall time of its run, and the verdict."""

    name: str
    rung: str
    recipe: str
    mode: str
    state: str
    run_dir: str
    ppl: float | None = None
    ppl_vs_fp: float | None = None
    ppl_vs_fp_lo: float | None = None
    ppl_vs_fp_hi: float | None = None
    size_mb: float | None = None
    latency_ms: float | None = None
    latency_source: str | None = None
    parity_passed: bool | None = None
    wall_s: float | None = None
    verdict: str = ""


@dataclass
class RungRecord:
    """One rung: ``state`` ``tried`` or ``skipped``, ``reason`` (why it was skipped; for a tried rung, the entries it
    left out and why), its candidates (run names) and this ship's wall time on it."""

    name: str
    why: str
    state: str
    reason: str = ""
    candidates: list[str] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass
class ShipRecord:
    """``ship.json``. ``outcome``: ``chosen``, ``impossible`` (no candidate meets everything: ``closest`` names the
    nearest) or ``running`` (written after each rung; a killed ship leaves it so). ``wall_s``: this invocation;
    ``candidates_wall_s``: the candidates' own runs, whenever they ran (a resumed ship reuses them)."""

    config: str
    ship_dir: str
    goal: dict
    outcome: str
    decision: str = ""
    stop_reason: str = ""
    chosen: str | None = None
    chosen_pte: str | None = None
    chosen_config: str | None = None
    chosen_recipe: str | None = None
    rerun: str | None = None
    tied: list[str] = field(default_factory=list)
    closest: str | None = None
    rungs: list[RungRecord] = field(default_factory=list)
    candidates: list[CandidateRecord] = field(default_factory=list)
    wall_s: float = 0.0
    candidates_wall_s: float = 0.0
    report: str | None = None

    def write(self, ship_dir: Path) -> None:
        """``ship.json`` and ``ship.md`` in ``ship_dir``, atomically."""
        write_json_atomic(ship_dir / SHIP_JSON, asdict(self))
        write_bytes_atomic(ship_dir / SHIP_MD, markdown(self).encode())

    @classmethod
    def read(cls, path: str | Path) -> ShipRecord:
        data = json.loads(Path(path).read_text())
        data["rungs"] = [RungRecord(**r) for r in data.get("rungs", [])]
        data["candidates"] = [CandidateRecord(**c) for c in data.get("candidates", [])]
        return cls(**data)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:+.2%}"


def markdown(rec: ShipRecord) -> str:
    """``ship.md``: the outcome, the rungs, the candidates, the time spent."""
    g = rec.goal
    lines = [
        f"# qharness ship: {rec.outcome}",
        "",
        f"Config `{rec.config}`; goal: {g.get('text', '')}.",
        "",
        f"**Decision.** {rec.decision}",
        "",
    ]
    if rec.chosen:
        lines += [
            f"Ship `{rec.chosen_pte}`; recipe file `{rec.chosen_recipe}`; re-run: `{rec.rerun}`.",
            "",
        ]
    if rec.stop_reason:
        lines += [f"**Stopped.** {rec.stop_reason}", ""]
    lines += ["## Rungs", "", "| rung | state | why / reason | candidates | wall |", "|---|---|---|---|---|"]
    for r in rec.rungs:
        why = r.reason if r.state == "skipped" else "; ".join(filter(None, (r.why, r.reason)))
        lines.append(
            f"| {r.name} | {r.state} | {why.replace('|', '/')} | {', '.join(r.candidates) or '—'} | "
            f"{format_seconds(r.wall_s) if r.state != 'skipped' else '—'} |"
        )
    lines += [
        "",
        "## Candidates",
        "",
        "| candidate | rung | state | ppl | vs FP [95%, paired] | .pte MB | decode ms/token | wall | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in rec.candidates:
        ci = f"{_pct(c.ppl_vs_fp)} [{_pct(c.ppl_vs_fp_lo)}, {_pct(c.ppl_vs_fp_hi)}]" if c.ppl_vs_fp is not None else "—"
        lines.append(
            f"| {c.name} | {c.rung} | {c.state} | {'—' if c.ppl is None else f'{c.ppl:.3f}'} | {ci} | "
            f"{'—' if c.size_mb is None else f'{c.size_mb:.3f}'} | "
            f"{'—' if c.latency_ms is None else f'{c.latency_ms:.3g}'} | "
            f"{'—' if c.wall_s is None else format_seconds(c.wall_s)} | {c.verdict.replace('|', '/')} |"
        )
    lines += [
        "",
        f"Time: this ship {format_seconds(rec.wall_s)}; the candidates' own runs {format_seconds(rec.candidates_wall_s)} "
        "(whenever they ran: a resumed ship reuses finished ones).",
    ]
    if rec.report:
        lines.append(f"Report with every candidate and the Pareto plots: `{rec.report}`.")
    return "\n".join(lines) + "\n"
