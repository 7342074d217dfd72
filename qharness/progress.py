"""Progress on long stages: a tqdm bar where there are iterations, a start/finish line with the elapsed
time where there are none (export, lowering). Both go to stderr, so stdout keeps the tables.

Example::

    with stage("lowering to ExecuTorch (xnnpack_int8_dynamic)"):
        pte_bytes = lower_to_pte(...)
    with stage("lowering: export", quiet_below=10):   # silent unless it runs 10 s
        ...
    for x in bar(blocks, "scoring the .pte"):
        ...
    trainer = Trainer(callbacks=[lightning_progress_bar()])   # training bar: "Epoch 0", never "Epoch 0/-2"
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


def _say(text: str) -> None:
    print(f"[qharness] {text}", file=sys.stderr, flush=True)


def format_seconds(seconds: float) -> str:
    """``75.3`` -> ``1m15s``; below a minute, ``12.3s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m{secs:02d}s" if minutes >= 60 else f"{minutes}m{secs:02d}s"


@contextmanager
def stage(name: str, quiet_below: float | None = None) -> Iterator[None]:
    """Print ``name ...`` now and ``name: done in 12.3s`` (or ``failed after``) when the block ends.

    With ``quiet_below`` (seconds) a stage that ends sooner says nothing (tiny runs stay quiet); one still running
    then prints ``name ...`` at that moment and its end line when it ends."""
    if quiet_below is not None and quiet_below <= 0:
        quiet_below = None
    if quiet_below is None:
        _say(f"{name} ...")
    announced = _announce_after(quiet_below, f"{name} ...") if quiet_below is not None else None
    t = time.perf_counter()
    try:
        yield
    except BaseException:
        if announced is None or announced():
            _say(f"{name}: failed after {format_seconds(time.perf_counter() - t)}")
        raise
    if announced is None or announced():
        _say(f"{name}: done in {format_seconds(time.perf_counter() - t)}")


def _announce_after(seconds: float, text: str):
    """Say ``text`` in ``seconds`` unless the returned function is called first; it returns whether it was said."""
    import threading

    lock, state = threading.Lock(), {"said": None}  # None: not yet decided

    def announce():
        with lock:
            if state["said"] is None:
                state["said"] = True
                _say(text)

    timer = threading.Timer(seconds, announce)
    timer.daemon = True
    timer.start()

    def finish() -> bool:
        timer.cancel()
        with lock:
            if state["said"] is None:
                state["said"] = False
            return state["said"]

    return finish


def bar(iterable: Iterable | None, desc: str, total: int | None = None, unit: str = "it", delay: float = 0.0):
    """A tqdm progress bar on stderr (it stays when done, with its elapsed time); with ``delay`` (seconds) it shows
    only once it has run that long. ``iterable`` None: a bar of ``total`` steps moved by its ``update(n)``."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, delay=delay)


def lightning_progress_bar():
    """Lightning's default progress bar (Rich when installed, else tqdm), except that Rich's training bar reads
    ``Epoch 0`` when training is bounded by ``max_steps``: Rich writes ``Epoch {epoch}/{max_epochs - 1}``, which is
    ``Epoch 0/-2`` under the ``max_epochs=-1`` Lightning sets then."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    if not _RICH_AVAILABLE:
        return TQDMProgressBar()  # writes "Epoch N" alone

    class StepBoundRichProgressBar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            if (self.trainer.max_epochs or -1) > 0:
                return super()._get_train_description(current_epoch)
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"

    return StepBoundRichProgressBar()
