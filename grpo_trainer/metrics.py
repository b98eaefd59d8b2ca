"""Where metrics go: OUTPUT_DIR/metrics.jsonl (always), and the console.

Only the main process writes; values reaching here are already reduced over
ranks by the trainer. One JSON object per line, flushed at once, so a crashed
run keeps every step it finished.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, output_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")

    def restore(self, history: str) -> None:
        """On resume: the metrics file becomes the checkpoint's copy (steps after it will be logged again)."""
        if not self.enabled:
            return
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
