"""After the runs: every finished ``.pte`` that passed its parity gate timed jointly (fresh processes in alternating
rounds), so the report compares the programs under the same conditions; programs of one structure (``pte.structure``)
as one latency class, one figure."""

from __future__ import annotations

from pathlib import Path

from qharness.io.atomic import write_json_atomic


def bench_joint(sweep_dir: Path, records: list[dict], processes: int, bench: dict | None = None) -> dict | None:
    """Time the ``.pte`` of every finished run that passed its parity gate jointly (fresh processes in alternating
    rounds, ``processes`` each; those with one ``pte.structure`` as one latency class: ``joint.pool_classes``), with the
    sweep's bench lengths (``bench``: the shared config's ``bench`` section; the runs'
    own benchmark may be off, ``bench.enabled: false``); add ``bench_joint`` to each run's summary.json and write
    ``<sweep_dir>/bench_joint.json``."""
    from qharness.config import BenchConfig
    from qharness.run.summary import RunSummary
    from qharness.runtime.joint import bench_jointly, joint_entry

    ptes, summaries = {}, {}
    for r in records:
        path = Path(r["run_dir"]) / "summary.json"
        if r["state"] == "failed" or not path.is_file():
            continue
        summary = RunSummary.read(path)
        pte = summary.pte_file(r["run_dir"])
        if summary.passed and pte.suffix == ".pte" and pte.is_file():  # ran here and passed the gate
            ptes[r["name"]], summaries[r["name"]] = pte, (path, summary)
    if not ptes or processes == 0:
        return None
    defaults = BenchConfig()
    b = {"prompt_len": defaults.prompt_len, "decode_tokens": defaults.decode_tokens, "reps": defaults.reps}
    b.update({k: v for k, v in (bench or {}).items() if k in b})  # the same lengths in every run of a sweep
    print(
        f"[sweep] timing {len(ptes)} programs jointly: {processes} fresh processes each, alternating rounds", flush=True
    )
    joint = bench_jointly(
        list(ptes.values()),
        b["prompt_len"],
        b["decode_tokens"],
        max(10, b["reps"]),
        processes,
        names=list(ptes),
        log=lambda line: print(line, flush=True),
        classes={name: summary.pte.structure for name, (_, summary) in summaries.items()},
    )
    for name, (path, _) in summaries.items():
        RunSummary.update(path, bench_joint=joint_entry(joint, name))
    write_json_atomic(sweep_dir / "bench_joint.json", joint)
    return joint
