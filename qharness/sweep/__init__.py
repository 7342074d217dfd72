"""``qharness sweep CONFIG``: the FP baseline and recipes x modes on one model and data, then the report.

A sweep config names the shared run config (``config``: the groups of a fit/calibrate config), the FP
``baseline`` recipe (run first, PTQ) and ``runs``: recipes with their modes (and optionally their own ``config``
over the shared one, and a ``name`` in place of the recipe's, for variants of one recipe). Each run is its own run
directory ``<sweep_dir>/<name or recipe>-<mode>/`` run by the ordinary CLI in a fresh process (``qharness fit`` for
QAT, ``qharness calibrate`` for PTQ) from the generated ``sweep_config.yaml`` there; its output goes to the
console and to ``sweep.log`` there. A failed run is recorded and the sweep goes on. A re-run skips every run
that finished with the same generated config (``sweep_status.json`` + ``summary.json``) and resumes a QAT run
of that config that was killed or failed (``--ckpt_path last``, ``resumable``); ``--force`` reruns all. A run's name must be one plain directory name
(``io.names.check_name``: no separators, ``..`` or control characters), so every run stays inside ``sweep_dir``; a run
process starts with ``python -P`` (nothing from the current directory is imported). A run's
process gets SIGTERM when the sweep dies, so a killed sweep leaves nothing running. The embedded default model
is resolved (pretrained once, cached) before the first run, so the runs share it; the eager FP model is benchmarked only in the first run (``bench.eager: false`` in the others). lm-eval
(unless the config sets ``eval.models``) scores the FP model and ``.pte`` in the baseline run, the ``.pte`` in
PTQ runs and the fake-quant model and ``.pte`` in QAT runs. Once all runs are finished, every finished run's
``.pte`` is timed jointly (``qharness.runtime.joint.bench_jointly``: ``report.bench_processes`` fresh processes per
program, default 5, alternating rounds; 0 skips it): each run's summary.json gets ``bench_joint`` and
``<sweep_dir>/bench_joint.json`` holds them all, so the programs are compared under the same conditions. The
sweep ends with ``qharness report <sweep_dir>`` (``report`` section: metric and budgets).

``jobs: N`` (or ``--jobs N``) runs up to N runs at a time, each with its share of the cores (``OMP_NUM_THREADS``,
``QHARNESS_THREADS``: cores // N, unless set), in plan order; a run whose config names an earlier run's directory
(an ``autotuned.yaml`` recipe, a ``model.distill.teacher``) waits for it. Their output then goes to their
``sweep.log`` only. Much of a run is single-threaded (imports, export, lowering, the parity gate), so two runs at a
time finish a sweep sooner on a few cores. The joint benchmark still runs alone, after every run; a run's own
``qharness bench`` would time under the others' load, so ``jobs`` > 1 needs the joint benchmark
(``report.bench_processes`` >= 1), whose numbers the report uses.

Example config::

    sweep_dir: runs/sweep_xnnpack
    baseline: xnnpack_fp32
    runs:
      - {recipe: xnnpack_int8_dynamic, modes: [ptq, qat]}
      - {recipe: xnnpack_int8_dynamic, modes: [qat], name: int8_distill, config: {model: {distill: {}}}}
    config:
      model: {checkpoint: embedded}
      trainer: {max_steps: 100}
    report: {max_size_mb: 2.0}

A run entry may also name an autotune budget instead of (or with) a recipe: ``{autotune: {max_size_mb: 1.6},
modes: [ptq]}`` runs ``qharness autotune`` (base recipe: ``recipe``, default ``xnnpack_8da4w``; other keys of
``autotune``: ``candidates``, ``unit``, ``sensitivity``) in ``<sweep_dir>/<name or autotune_<budget>mb>-<mode>/``, so
its ``.pte`` joins the report and the Pareto plots; its ``autotuned.yaml`` is a recipe file that a later entry (or
any run) can name as ``recipe``.

Modules, in the order a sweep uses them: ``spec.py`` (the config read and checked), ``plan.py`` (the runs and their
configs, ``SweepRun``), ``resume.py`` (``sweep_status.json``: skip a finished run, resume a killed one), ``launch.py``
(a run's process and its log), ``scheduler.py`` (``run_sweep``: the runs one or ``jobs`` at a time, then the rest),
``joint_bench.py`` (the joint benchmark after the runs).
"""
