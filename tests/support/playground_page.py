"""Drive the playground page (deployments/static/) in a real headless Chromium through Selenium
and the packaged chromedriver (Debian's `chromium` + `chromium-driver`; nothing downloaded).
Used by the browser test and by benchmarks/playground_shot.py (the README's screenshot)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = "chromedriver"


def browser_missing() -> str:
    """Why no browser test can run here ('' when it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    if not any(shutil.which(c) for c in CHROMIUM) or not shutil.which(CHROMEDRIVER):
        return "no chromium + chromedriver found (apt-get install chromium chromium-driver; .ci/run does)"
    return ""


@dataclass(frozen=True)
class PanelState:
    status: str
    error: str
    text: str
    sources: list[int]  # per token span, in order
    counters: dict[str, str]  # displayed: rate, large-calls, tokens, tps, ttft
    usage: dict | None  # the final chunk's usage, as the page received it


class PlaygroundPage:
    """One headless Chromium on `url`/playground."""

    def __init__(self, url: str, width: int = 1400, height: int = 900) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = next(shutil.which(c) for c in CHROMIUM if shutil.which(c))
        for arg in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--disable-gpu",
            f"--window-size={width},{height}",
            "--no-first-run",
            "--disable-extensions",
        ):
            options.add_argument(arg)
        # the packaged driver: Selenium Manager would otherwise try to download one
        self.driver = webdriver.Chrome(service=Service(executable_path=shutil.which(CHROMEDRIVER)), options=options)
        self.driver.set_window_size(width, height)
        self.driver.get(f"{url}/playground")

    def close(self) -> None:
        self.driver.quit()

    def __enter__(self) -> "PlaygroundPage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait(self, condition: str, timeout_s: float = 60.0, *args):
        """Poll a JS expression (`return ...`) until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.js(condition, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"page condition not met in {timeout_s} s: {condition}\n{self.console()}")
            time.sleep(0.1)

    def console(self) -> str:
        try:
            return "\n".join(str(e) for e in self.driver.get_log("browser"))
        except Exception:  # noqa: BLE001 - diagnostics only
            return ""

    def key_dialog(self) -> tuple[bool, str]:
        """(shown, the message under it)."""
        return self.js(
            "return [!document.getElementById('key-dialog').hidden, document.getElementById('key-error').textContent]"
        )

    def enter_key(self, key: str) -> None:
        self.js(
            "document.getElementById('key-input').value = arguments[0];document.getElementById('key-submit').click();",
            key,
        )

    def ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the routing info is in (the Run button is enabled)."""
        self.wait("return !document.getElementById('run').disabled", timeout_s)

    def set(self, **fields) -> None:
        """Common fields by element id (prompt, mode, temperature, max-tokens, seed, ignore-eos, compare)."""
        for name, value in fields.items():
            self.js(
                """const el = document.getElementById(arguments[0]);
                       if (el.type === 'checkbox') el.checked = arguments[1]; else el.value = arguments[1];
                       el.dispatchEvent(new Event(el.type === 'checkbox' ? 'change' : 'input'));
                       el.dispatchEvent(new Event('change'));""",
                name.replace("_", "-"),
                value,
            )

    def set_panel(
        self, panel: str, router: str, thresholds: list[float] | None = None, target: float | None = None
    ) -> None:
        """Panel 'a' or 'b': router, then its thresholds (one per boundary) or a target backoff rate."""
        self.js(
            """const p = document.getElementById('panel-' + arguments[0]);
                   const r = p.querySelector('.router'); r.value = arguments[1]; r.dispatchEvent(new Event('change'));
                   const c = p.querySelector('.control');
                   c.value = arguments[3] === null ? 'threshold' : 'target'; c.dispatchEvent(new Event('change'));
                   if (arguments[3] !== null) { const t = p.querySelector('.target'); t.value = arguments[3];
                                                t.dispatchEvent(new Event('input')); }
                   (arguments[2] || []).forEach((v, i) => { const n = p.querySelectorAll('input.threshold')[i];
                                                            n.value = v; n.dispatchEvent(new Event('input')); });""",
            panel,
            router,
            thresholds,
            target,
        )

    def run(self, timeout_s: float = 120.0) -> None:
        """Click Run and wait until every visible panel has finished (done, error or stopped)."""
        self.js("document.getElementById('run').click()")  # disables Run before it returns
        self.wait("return !document.getElementById('run').disabled", timeout_s)

    def panel(self, name: str) -> PanelState:
        raw = self.js(
            """const p = document.getElementById('panel-' + arguments[0]);
            const t = (c) => p.querySelector('.' + c).textContent;
            return {status: t('status'), error: t('problem'),
                    text: [...p.querySelectorAll('.output .tok')].map(s => s.textContent).join(''),
                    sources: [...p.querySelectorAll('.output .tok')].map(s => +s.dataset.source),
                    counters: {rate: t('c-rate'), 'large-calls': t('c-large-calls'), tokens: t('c-tokens'),
                               tps: t('c-tps'), ttft: t('c-ttft')},
                    usage: p.dataset.usage || null};""",
            name,
        )
        usage = raw.pop("usage")
        return PanelState(usage=json.loads(usage) if usage else None, **raw)

    def screenshot(self, path: str | Path) -> Path:
        """The whole page (the window grows to the document's height first)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        height = self.js("return document.documentElement.scrollHeight")
        width = self.js("return window.outerWidth")
        self.driver.set_window_size(width, max(400, int(height) + 20))
        self.driver.save_screenshot(str(path))
        return path
