"""Pages in a real headless Chromium (Debian's ``chromium``): a screenshot, the console messages
the page logged, and how much the screenshot varies (a blank page does not). Skipped where Chromium
is not installed, unless ``BATCHINFER_REQUIRE_CHROMIUM`` is set (CI: ``.ci/run`` installs it).
Used by the job report's and the history page's tests."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest


def chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("BATCHINFER_REQUIRE_CHROMIUM"):
        pytest.fail("chromium is required here (BATCHINFER_REQUIRE_CHROMIUM) but not installed")
    return found


def render(page: Path, shot: Path, height: int = 2400) -> list[str]:
    """Screenshot ``page`` in headless Chromium; return the console messages it logged."""
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; CI installs it)")
    result = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", "--enable-logging=stderr", "--v=0", f"--window-size=1280,{height}",
         f"--user-data-dir={shot.parent / 'chromium-profile'}", f"--screenshot={shot}",
         page.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def pixel_spread(shot: Path) -> float:
    from PIL import Image

    image = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    return float(image.std())
