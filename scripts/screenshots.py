"""Screenshots of the status page in the states the browser tests check
(`make screenshots`): the simulator in the exhaustion, prefix-change and
slow-first-token phases, four engines, the engine down; at 1400 px (light)
and 400 px (dark). Written to docs/screenshots/, shown in the README.

No test compares these pixels with a fresh render: fonts, anti-aliasing and
Chromium's version change them without the page changing, so such a check
would fail for the wrong reasons. tests/test_statuspage_browser.py checks
what the pictures show (banner, highlighted figures, overflow, charts);
rerun this after changing the page.

    .venv/bin/python scripts/screenshots.py [--out docs/screenshots]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from browser import Browser  # noqa: E402
from sim_support import sim_monitor  # noqa: E402
from pageserver import serving  # noqa: E402
from test_statuspage_browser import CASES  # noqa: E402

from kvwatch.sidecar.app import create_app  # noqa: E402
from kvwatch.pipeline.monitor import Monitor  # noqa: E402
from kvwatch.settings import load_settings  # noqa: E402


def shrink(path: Path) -> None:
    """A 256-colour palette: a third of the bytes, the same picture to a reader."""
    try:
        from PIL import Image
    except ImportError:  # Pillow comes with the test extra (matplotlib); without it the PNG stays full colour
        return
    with Image.open(path) as image:
        image.convert("RGB").quantize(256, dither=Image.Dither.NONE).save(path, optimize=True)


def monitors():
    for case, (scenario, until, *_) in CASES.items():
        yield case, sim_monitor(scenario, until)
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "timeout": 0.5}, environ={})
    down = Monitor(settings)
    down.poll_once()  # refused: nothing listens on port 9
    yield "engine-down", down


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with Browser() as browser:
        for case, monitor in monitors():
            with serving(create_app(monitor, monitor.settings), lifespan="off", start_timeout_s=10) as kvwatch:
                for width, dark in ((1400, False), (400, True)):
                    page = browser.page(width, 900, dark)
                    page.goto(kvwatch.url + "/")
                    page.wait_for("document.body.dataset.rendered === '1'")
                    problems = page.messages()
                    if problems:
                        print(f"{case} at {width} px: {problems}", file=sys.stderr)
                        return 1
                    path = args.out / f"{case}-{width}.png"
                    page.screenshot(path)
                    shrink(path)
                    print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
