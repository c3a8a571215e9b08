"""Headless Debian Chromium through selenium, for the dashboard tests: one way to start it, read the page in
one script (the page re-renders every 5 s, which stales element handles), and save screenshots."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# The flags the issue names: nothing reaches the network or a profile outside the test's own folder.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
)
SCREENSHOTS_ENV = "PRIME_NODE_DASHBOARD_SCREENSHOTS"  # a folder: screenshots are copied there (docs/img)


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    """A selenium Chrome driver on /usr/bin/chromium with a fresh profile in `profile`; skips, naming what is
    missing, where selenium or chromium is not installed (scripts/setup.sh installs both)."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium not installed (pip install -e .[dev])"
    )
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver_path:
        pytest.skip("chromium and chromium-driver not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()


def wait_loaded(driver: Any, timeout: float = 30) -> None:
    """Until the page's first render is done (dashboard.js sets body[data-loaded])."""
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    WebDriverWait(driver, timeout).until(
        lambda d: d.execute_script("return document.body.dataset.loaded") == "1"
    )


def wait_for(driver: Any, script: str, timeout: float = 30) -> Any:
    """Until `script` (a JS expression) is truthy; returns its value."""
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(f"return ({script});"))


def screenshot(driver: Any, folder: Path, name: str, width: int) -> Path:
    """A screenshot of the whole page at `width` px (the window grows to the page's height), saved in `folder`
    and, when PRIME_NODE_DASHBOARD_SCREENSHOTS names a folder, copied there."""
    driver.set_window_size(width, 900)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(int(height) + 20, 6000))
    path = folder / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"no screenshot {path}"
    extra = os.environ.get(SCREENSHOTS_ENV)
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(extra) / path.name)
    return path


def severe_console_errors(driver: Any) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
