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

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint (they will be logged again)."""
        if not self.enabled or not self.path.exists():
            return
        self._file.close()
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()

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
