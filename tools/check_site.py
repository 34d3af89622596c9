"""The built documentation site as a reader gets it (tools/docs runs this after the build).

    .venv/bin/python tools/check_site.py [--require-browser] [SITE]   # SITE: docs/_build/html

1. Every internal link of every page resolves: the file it names exists in the site, and so does
   the ``#anchor`` in that file (Sphinx checks its own cross-references; this also covers links
   written in raw HTML, the theme's and the generated pages').
2. Headless Chromium opens the front page and the Python API page: each is screenshotted into
   ``SITE/_screenshots/`` (kept with the site: a CI artifact), the screenshot must show a page
   (not a blank or an error page), and the DOM Chromium rendered must hold the page's own text.
   Without Chromium this step says so and is skipped, or fails with ``--require-browser`` (CI).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
# Pages opened in the browser, with text each must show once rendered.
PAGES = {"index.html": ["Get started", "Python API"], "reference/api.html": ["sparkdl.run", "TrainState"]}


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if found.get(key):
                self.ids.add(str(found[key]))
        for key in ("href", "src"):
            if found.get(key) and tag in ("a", "link", "img", "script"):
                self.links.append(str(found[key]))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def broken_links(site: Path) -> tuple[int, list[str]]:
    """(internal links checked, the broken ones as "page: link (why)")."""
    pages = {p: _parse(p) for p in site.rglob("*.html")}
    checked, broken = 0, []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//"):
                continue  # another site, mailto:, data:
            checked += 1
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(site)}: {link}"
            if not target.is_file() or not target.is_relative_to(site.resolve()):
                broken.append(f"{where} (no such file in the site)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{where} (no #{parts.fragment} in {target.relative_to(site.resolve())})")
    return checked, broken


def browser() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None)


def render(exe: str, page: Path, shot: Path, profile: str) -> str:
    """Screenshots ``page`` into ``shot``; returns the DOM Chromium rendered."""
    common = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
              f"--user-data-dir={profile}", "--window-size=1280,1400"]
    for argv in ([*common, f"--screenshot={shot}", page.as_uri()], [*common, "--dump-dom", page.as_uri()]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(exe).name} failed on {page} ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def looks_like_a_page(shot: Path) -> str | None:
    """None when the screenshot shows a page: many colours, ink over a good part of it."""
    from PIL import Image, ImageChops

    with Image.open(shot) as image:
        rgb = image.convert("RGB")
        colours = len(rgb.resize((320, 350)).getcolors(maxcolors=320 * 350) or [])
        ink = ImageChops.difference(rgb, Image.new("RGB", rgb.size, (255, 255, 255))).getbbox()
    if colours < 50:
        return f"only {colours} colours: a blank or an error page"
    if ink is None or (ink[2] - ink[0]) * (ink[3] - ink[1]) < 0.3 * rgb.size[0] * rgb.size[1]:
        return f"ink covers only {ink}: the page did not render"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default=str(ROOT / "docs" / "_build" / "html"))
    parser.add_argument("--require-browser", action="store_true", help="fail when no Chromium is installed")
    args = parser.parse_args()
    site = Path(args.site).resolve()
    checked, broken = broken_links(site)
    for line in broken:
        print(f"[check-site] broken link: {line}")
    print(f"[check-site] {checked} internal links in {len(list(site.rglob('*.html')))} pages: {len(broken)} broken")
    failed = bool(broken)
    exe = browser()
    if exe is None:
        print("[check-site] no Chromium installed (apt-get install chromium): the pages were not rendered"
              + (" -- required here" if args.require_browser else ""))
        return 1 if failed or args.require_browser else 0
    shots = site / "_screenshots"
    shots.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        for rel, texts in PAGES.items():
            shot = shots / (rel.replace("/", "-").removesuffix(".html") + ".png")
            dom = render(exe, site / rel, shot, profile)
            missing = [t for t in texts if t not in dom]
            problem = looks_like_a_page(shot) or (f"the rendered page lacks {missing}" if missing else None)
            print(f"[check-site] {rel} in {Path(exe).name}: " + (f"FAILED: {problem}" if problem else
                  f"rendered, {len(dom):,} bytes of DOM, screenshot {shot.relative_to(site)}"))
            failed |= problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
