"""The `kvwatch` command. Each subcommand lives in its own module, which exposes
`add_arguments(parser)` and `run(args) -> int`. This file only dispatches, and
imports only the module of the subcommand that runs, so `kvwatch serve` never
pays for matplotlib or grafanalib."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "serve": ("kvwatch.commands.serve", "poll a vLLM /metrics and serve kvwatch's signals"),
    "sim": ("kvwatch.commands.sim", "run a simulated vLLM engine (for demos and tests)"),
    "diagnose": ("kvwatch.commands.diagnose",
                 "poll a target for a while (or replay a capture) and print signals and findings"),
    "capture": ("kvwatch.commands.capture", "record a target's /metrics pages with their times, to hand over or replay"),
    "generate": ("kvwatch.commands.generate", "write dashboards, rules, runbooks and manifests"),
    "runbook": ("kvwatch.commands.runbook", "print the runbook section an alert or a finding names"),
    "capacity": ("kvwatch.commands.capacity", "KV bytes per token and the concurrency a KV budget holds"),
    "sweep": ("kvwatch.commands.sweep", "measure a server across lengths and concurrency levels"),
}


def _negative_values(argv: list[str]) -> list[str]:
    """`--duration -1s` as `--duration=-1s`: argparse takes a value that
    starts with '-' for an option and answers "expected one argument" with
    its usage; joined, the flag's own parser says what is wrong with it."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if (token.startswith("--") and "=" not in token and i + 1 < len(argv)
                and len(argv[i + 1]) > 1 and argv[i + 1][0] == "-" and (argv[i + 1][1].isdigit() or argv[i + 1][1] == ".")):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's message for arguments no option takes, with the nearest
    option for each unknown flag (`--durration`: did you mean --duration?)."""
    import difflib

    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        if flag.startswith("--"):
            near = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
            if near:
                hints.append(f"{flag}: did you mean {near[0]}?")
    return f"unrecognized arguments: {' '.join(extras)}" + ("".join(f"\n  {h}" for h in hints))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from kvwatch import __version__

    parser = argparse.ArgumentParser(prog="kvwatch", description="KV-cache observability for vLLM.")
    parser.add_argument("--version", action="version", version=f"kvwatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        parsers[name] = sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:
            importlib.import_module(module_name).add_arguments(sub_parser)
    args, extras = parser.parse_known_args(_negative_values(argv))
    if extras:
        # The subcommand's usage, not the top level's, and the flag it likely meant.
        parsers[args.command].error(unrecognized(parsers[args.command], extras))
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:
        # `kvwatch generate --print-config | head`: the reader left; that is
        # not an error worth a traceback. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
