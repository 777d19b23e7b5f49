"""The test command itself keeps its documented promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_skipped_test_prints_its_reason(tmp_path: Path) -> None:
    """The README says a test skipped for a missing service prints why: plain ``pytest``,
    with the project's configuration, must show the reason, not only an ``s``."""
    (tmp_path / "test_skipping.py").write_text(
        "import pytest\n\n\ndef test_x():\n    pytest.skip('needs the moon to be full')\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_skipping.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 skipped" in out.stdout, out.stdout + out.stderr
    assert "needs the moon to be full" in out.stdout
