"""Measure how the built site lays out in a real browser: what overflows, at which width.

Headless Chromium's ``--window-size`` does not go below 500 CSS pixels, so a phone's 390 px
is emulated through the DevTools protocol (``Emulation.setDeviceMetricsOverride``), the same
way the browser's device toolbar does it. Each page is loaded at each width and a script
counts, inside the article:

- output blocks (``pre`` of a cell output or a code block) that scroll sideways,
- tables wider than the article (the reader must scroll to see their last columns),
- elements that stick out of the viewport (the page itself scrolls sideways),
- side navigation entries that wrap inside a word.

Run it on a built site (before and after a change) to get the same counts again::

    python tests/helpers/site_layout.py docs/_build/html [--shots DIR]

``--shots`` also saves a screenshot of the key pages at each width.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WIDTHS = (1280, 390)
# The pages the acceptance names; the counts cover every page of the site.
KEY_PAGES = (
    "index.html",
    "notebooks/04_fully_sharded_data_parallel.html",
    "notebooks/09_deepspeed_zero.html",
    "api/index.html",
    "guide/will_it_fit.html",
    "cli.html",
)
# For a second screenshot, scrolled to what the reader came for: (selector, text it holds).
FOCUS = {
    "index.html": ("table", "PyTorch"),
    "notebooks/04_fully_sharded_data_parallel.html": ("table", "predicted"),
    "notebooks/09_deepspeed_zero.html": ("table", "master"),
    "guide/will_it_fit.html": ("table", "recommended"),
    "cli.html": ("pre", "fits"),
}

# Run in the page: what overflows, with enough detail to find it.
PROBE = r"""
(() => {
  const article = document.querySelector('article.bd-article') || document.body;
  const limit = article.getBoundingClientRect().right + 1;
  const view = document.documentElement.clientWidth;
  const label = (el) => {
    const text = (el.innerText || '').trim().split('\n')[0];
    return text.slice(0, 60);
  };
  // Outputs: a cell's output, and console/text blocks (what a command printed).
  const outputs = [...article.querySelectorAll(
    '.cell_output pre, div.highlight-console pre, div.highlight-text pre, div.highlight-none pre')];
  const scrolling = outputs.filter((el) => el.scrollWidth > el.clientWidth + 1).map(label);
  const code = [...article.querySelectorAll('pre')].filter((el) => !outputs.includes(el))
    .filter((el) => el.scrollWidth > el.clientWidth + 1).length;
  const tables = [...article.querySelectorAll('table')]
    .filter((el) => el.getBoundingClientRect().right > limit
                 || (el.parentElement && el.parentElement.scrollWidth
                     > el.parentElement.clientWidth + 1))
    .map((el) => {
      const head = [...el.querySelectorAll('th')].map((th) => th.innerText.trim());
      return head.join(' | ').slice(0, 80) || label(el);
    });
  const offscreen = [...document.querySelectorAll('body *')]
    .filter((el) => {
      const box = el.getBoundingClientRect();
      if (box.width === 0 || box.right <= view + 1) return false;
      if (getComputedStyle(el).visibility === 'hidden') return false;  // a closed drawer
      // Inside a box that scrolls sideways on its own, overflow is reachable.
      for (let p = el.parentElement; p; p = p.parentElement) {
        const s = getComputedStyle(p);
        if (['auto', 'scroll', 'hidden'].includes(s.overflowX)) return false;
      }
      return true;
    })
    .map((el) => el.tagName.toLowerCase() + '.' + [...el.classList].join('.') + ': ' + label(el));
  // Side navigation entries whose text wraps inside a word ("launcher.magi|c").
  const midword = [];
  document.querySelectorAll('nav.bd-links a').forEach((link) => {
    if (!link.offsetParent || getComputedStyle(link).visibility === 'hidden') return;
    const walker = document.createTreeWalker(link, NodeFilter.SHOW_TEXT);
    let top = null, before = ' ';
    while (walker.nextNode()) {
      const node = walker.currentNode;
      for (let i = 0; i < node.length; i++) {
        const range = document.createRange();
        range.setStart(node, i);
        range.setEnd(node, i + 1);
        const box = range.getClientRects()[0];
        const char = node.nodeValue[i];
        if (!box || /\s/.test(char)) { before = char; continue; }
        if (top !== null && box.top > top + 2 && !/[\s.\-]/.test(before)) {
          midword.push(link.innerText.trim().replace(/\s+/g, ' '));
        }
        top = box.top;
        before = char;
      }
    }
  });
  return {
    article: Math.round(article.getBoundingClientRect().width),
    scrolling, code, tables, offscreen, midword: [...new Set(midword)],
    page_scrolls: document.documentElement.scrollWidth > view + 1,
  };
})()
"""


@dataclass
class Layout:
    """What overflows on one page at one width."""

    page: str
    width: int
    article: int
    scrolling: list[str]
    code: int
    tables: list[str]
    offscreen: list[str]
    midword: list[str]
    page_scrolls: bool


class Browser:
    """One headless Chromium, driven over the DevTools protocol."""

    def __init__(self, executable: str) -> None:
        import websocket  # websocket-client, installed with Jupyter

        self._profile = tempfile.mkdtemp(prefix="site-layout-")
        self._process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self._process.poll() is not None:
                self.close()
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.05)
        try:
            port = port_file.read_text().split()[0]
            targets = json.loads(_http_get(f"http://127.0.0.1:{port}/json"))
            page = next(t for t in targets if t.get("type") == "page")
            self._ws = websocket.create_connection(
                page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True
            )
            self._id = 0
            self.call("Page.enable")
        except BaseException:
            self.close()  # never leave a browser behind
            raise

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))

    def open(self, url: str, width: int, height: int = 900) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=width < 600,
        )
        self.call("Page.navigate", url=url)
        # Wait for the load, then for web fonts and the theme's scripts to settle.
        deadline = time.monotonic() + 30
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not load")
            time.sleep(0.05)
        self.evaluate("document.fonts.ready.then(() => true)")
        time.sleep(0.2)

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        return result.get("result", {}).get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if hasattr(self, "_ws"):
            self._ws.close()
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._profile, ignore_errors=True)


def _http_get(url: str) -> str:
    from urllib.request import urlopen

    with urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def chromium() -> str | None:
    """The Chromium executable, if this machine has one."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@contextmanager
def browser() -> Iterator[Browser]:
    executable = chromium()
    if executable is None:
        raise RuntimeError("no Chromium on this machine (apt-get install chromium)")
    instance = Browser(executable)
    try:
        yield instance
    finally:
        instance.close()


def measure(
    site: Path, pages: list[str], widths: tuple[int, ...] = WIDTHS, shots: Path | None = None
) -> list[Layout]:
    """Load every page at every width and return what overflows."""
    found = []
    with browser() as b:
        for width in widths:
            for name in pages:
                b.open((site / name).resolve().as_uri(), width)
                found.append(Layout(page=name, width=width, **b.evaluate(PROBE)))
                if shots is not None and name in KEY_PAGES:
                    stem = name.replace("/", "_").removesuffix(".html")
                    b.screenshot(shots / f"{stem}-{width}.png")
                    if name in FOCUS:
                        selector, text = FOCUS[name]
                        b.evaluate(
                            f"[...document.querySelectorAll({selector!r})]"
                            f".find((el) => el.innerText.includes({text!r}))"
                            "?.scrollIntoView({block: 'start'})"
                        )
                        time.sleep(0.2)
                        b.screenshot(shots / f"{stem}-{width}-focus.png")
    return found


def site_pages(site: Path) -> list[str]:
    """Every page of the site, less the theme's templates and the highlighted sources."""
    skip = {"_static", "_modules", "_sources"}
    return sorted(
        str(p.relative_to(site))
        for p in site.rglob("*.html")
        if not skip & set(p.relative_to(site).parts)
        and p.name not in {"search.html", "genindex.html"}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site, e.g. docs/_build/html")
    parser.add_argument("--shots", type=Path, help="save screenshots of the key pages here")
    parser.add_argument("--json", type=Path, help="write every finding to this file")
    args = parser.parse_args()
    if args.shots:
        args.shots.mkdir(parents=True, exist_ok=True)
    layouts = measure(args.site, site_pages(args.site), shots=args.shots)
    for width in WIDTHS:
        at = [x for x in layouts if x.width == width]
        scrolling = sum(len(x.scrolling) for x in at)
        tables = [x for x in at if x.tables]
        wide = [x.page for x in at if x.page_scrolls or x.offscreen]
        code = sum(x.code for x in at)
        print(
            f"{width} px: {scrolling} output blocks ({code} code blocks) scroll sideways, "
            f"tables overflow in "
            f"{len(tables)} pages ({sum(len(x.tables) for x in tables)} tables), "
            f"{len(wide)} pages wider than the screen, "
            f"{len({m for x in at for m in x.midword})} navigation entries broken inside a word"
        )
        for x in at:
            if x.page in KEY_PAGES:
                print(
                    f"  {x.page}: article {x.article} px, {len(x.scrolling)} scrolling, "
                    f"tables {x.tables}, off-screen {x.offscreen[:3]}"
                )
    if args.json:
        args.json.write_text(json.dumps([x.__dict__ for x in layouts], indent=1))


if __name__ == "__main__":
    main()
