"""`kvwatch runbook [SECTION]`: print a runbook section in the terminal (the
one a finding or an alert names, e.g. vllmkvcacheexhausted-long-requests, or
an alert's name), or list the sections. The same text `kvwatch serve`
serves at /runbooks and `kvwatch generate` writes to alerts/runbooks.md."""

from __future__ import annotations

import argparse
import re
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("section", nargs="?", help="a section's anchor (runbooks#<anchor>) or an alert's name; "
                                                   "none lists the sections")


def sections(markdown: str) -> dict[str, str]:
    """{anchor: the section's text up to the next anchor}."""
    parts = re.split(r'<a id="([\w-]+)"></a>\n', markdown)
    return {parts[i]: parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}


def run(args: argparse.Namespace) -> int:
    from kvwatch.sidecar.runbooks_page import markdown_text

    found = sections(markdown_text())
    if not args.section:
        for anchor, text in found.items():
            print(f"{anchor:60} {text.splitlines()[0].lstrip('# ')}")
        return 0
    anchor = args.section.split("#")[-1].strip().lower().replace("_", "-")
    if anchor not in found:
        close = [a for a in found if a.startswith(anchor) or anchor in a][:5]
        hint = f"; did you mean {', '.join(close)}?" if close else "; `kvwatch runbook` lists them"
        print(f"kvwatch runbook: no section {args.section!r}{hint}", file=sys.stderr)
        return 2
    print(found[anchor])
    return 0
