"""Where metrics go: OUTPUT_DIR/metrics.jsonl (always), and the console; and how phases are timed.

Only the main process writes; values reaching here are already reduced over
ranks by the trainer. One JSON object per line, flushed at once, so a crashed
run keeps every step it finished.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch


class PhaseTimer:
    """Wall seconds per phase of a step (the `timing/*` metrics), each phase also a torch.profiler range.

    A phase can be entered several times in a step (dynamic sampling draws again): its times add up.
    `scripts/profile_step.py` groups the profiled operators by these ranges.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        with torch.profiler.record_function(name):
            try:
                yield
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


class MetricsWriter:
    def __init__(self, output_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._file: TextIO | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")

    def restore(self, history: str) -> None:
        """On resume: the metrics file becomes the checkpoint's copy (steps after it will be logged again)."""
        if not self.enabled:
            return
        if self._file is not None:
            self._file.close()
        self.path.write_text(history)
        self._file = self.path.open("a")

    def history_with(self, record: dict[str, Any] | None) -> str:
        """The file's content plus `record`: what a checkpoint taken now should hold."""
        if not self.enabled:
            return ""
        text = self.path.read_text() if self.path.exists() else ""
        return text + (self._line(record) if record is not None else "")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(self._line(record))
        self._file.flush()

    @staticmethod
    def _line(record: dict[str, Any]) -> str:
        return json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null reads as "not measured"
    return value


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
