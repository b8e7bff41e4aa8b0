"""Scenario files: an engine configuration and a sequence of timed phases, each
with a workload (and optionally changed runtime engine knobs). Shipped scenarios
live in `kvwatch/scenarios/*.yaml` and are read from the package by name
(`healthy`), whatever the current directory holds; a file of your own is read
only by a path that says it is one: with a slash, or ending in .yaml or .yml
(`./demo`, `my.yaml`).

A phase changes what it names; everything else carries over from the phase
before it (the first phase starts from the top-level `workload`). Loading
reports every problem in the file at once, each with its location.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvwatch import units
from kvwatch.units import did_you_mean

from kvwatch.sim.engine import EngineConfig
from kvwatch.sim.story import Story, parse_story
from kvwatch.sim.workload import WorkloadSpec, parse_workload

TOP_KEYS = ("name", "description", "engines", "engine", "workload", "phases", "loop")
PHASE_KEYS = ("name", "duration", "workload", "engine", "note", "story")


class ScenarioError(ValueError):
    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(f"invalid scenario {source}: {len(problems)} problem(s)\n{lines}")


@dataclass
class Phase:
    name: str
    duration: float
    workload: WorkloadSpec
    engine: EngineConfig
    note: str = ""
    # What the diagnosis should say in this phase (kvwatch/sim/story.py); None: not scored.
    story: Story | None = None


@dataclass
class Scenario:
    name: str
    description: str
    engine: EngineConfig
    phases: list[Phase]
    loop: bool = False
    engines: int = 1
    source: str = ""

    @property
    def cycle_seconds(self) -> float:
        return sum(phase.duration for phase in self.phases)


def clock_text(seconds: float) -> str:
    """1:40, 27:00, 1:02:03: a countdown or a length as a clock reads."""
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def phase_line(status: dict) -> str:
    """`now: healthy, next: eviction-pressure in 0:30` from a phase status
    (Simulation.phase_status, SimServer.phase_status); the page says the same."""
    text = f"now: {status['phase']}"
    if status.get("next") is not None and status.get("next_in_seconds") is not None:
        text += f", next: {status['next']} in {clock_text(status['next_in_seconds'])}"
        if status.get("clock") == "simulated":
            text += " (simulated time)"
    else:
        text += " (the last phase; it lasts until the simulator stops)"
    return text


def _merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and "dist" not in value:
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_scenario(data: Any, source: str) -> Scenario:
    problems: list[str] = []
    if not isinstance(data, dict):
        raise ScenarioError(source, [f"top level: expected a mapping, got {type(data).__name__}"])
    name, description, engines, loop = _scenario_header(data, source, problems)
    engine = _engine_config(data, problems)
    raw_phases = data.get("phases")
    phases: list[Phase] = []
    if not isinstance(raw_phases, list) or not raw_phases:
        problems.append("phases: expected a non-empty list of phases")
        raw_phases = []
    workload_raw = data.get("workload") or {}
    if not isinstance(workload_raw, dict):
        problems.append(f"workload: expected a mapping, got {workload_raw!r}")
        workload_raw = {}
    phase_engine = engine
    for index, raw_phase in enumerate(raw_phases):
        if not isinstance(raw_phase, dict):
            problems.append(f"phases[{index}]: expected a mapping, got {raw_phase!r}")
            continue
        # Each phase's workload and engine are the ones before it, changed.
        phase, workload_raw, phase_engine = _parse_phase(index, raw_phase, workload_raw, phase_engine, problems)
        if phase is not None:
            phases.append(phase)
    if problems:
        raise ScenarioError(source, problems)
    return Scenario(name, description, engine, phases, loop, engines, source)


def _scenario_header(data: dict, source: str, problems: list[str]) -> tuple[str, str, int, bool]:
    """The scenario's name, description, engine count and loop flag (defaults where wrong, each said)."""
    for key in data:
        if key not in TOP_KEYS:
            problems.append(f"{key}: unknown top-level key{did_you_mean(key, TOP_KEYS)} (expected one of {', '.join(TOP_KEYS)})")
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        problems.append(f"name: expected a non-empty string, got {name!r}")
        name = Path(source).stem
    description = data.get("description", "")
    if not isinstance(description, str):
        problems.append("description: expected a string")
        description = ""
    engines = data.get("engines", 1)
    if not isinstance(engines, int) or isinstance(engines, bool) or not 1 <= engines <= 64:
        problems.append(f"engines: expected an integer from 1 to 64, got {engines!r}")
        engines = 1
    loop = data.get("loop", False)
    if not isinstance(loop, bool):
        problems.append(f"loop: expected true or false, got {loop!r}")
        loop = False
    return name, description, engines, loop


def _engine_config(data: dict, problems: list[str]) -> EngineConfig:
    known = EngineConfig.field_names()
    raw_engine = data.get("engine") or {}
    engine = EngineConfig()
    if not isinstance(raw_engine, dict):
        problems.append(f"engine: expected a mapping, got {raw_engine!r}")
        return engine
    unknown = [key for key in raw_engine if key not in known]
    for key in unknown:
        problems.append(f"engine.{key}: unknown engine setting{did_you_mean(key, known)} (expected one of {', '.join(sorted(known))})")
    engine = replace(engine, **{k: v for k, v in raw_engine.items() if k in known})
    problems.extend(engine.problems("engine"))
    return engine


def _parse_phase(index: int, raw_phase: dict, workload_raw: dict, phase_engine: EngineConfig,
                 problems: list[str]) -> tuple[Phase | None, dict, EngineConfig]:
    """One phase (None when its workload is wrong), with the workload and engine it leaves to the next."""
    where = f"phases[{index}]"
    phase_name = raw_phase.get("name")
    if isinstance(phase_name, str) and phase_name:
        where = f"phases[{index}] ({phase_name})"
    else:
        if phase_name is not None:
            problems.append(f"{where}.name: expected a non-empty string, got {phase_name!r}")
        phase_name = f"phase-{index + 1}"
    for key in raw_phase:
        if key not in PHASE_KEYS:
            problems.append(f"{where}.{key}: unknown phase key{did_you_mean(key, PHASE_KEYS)} (expected one of {', '.join(PHASE_KEYS)})")
    duration = _phase_duration(raw_phase, where, problems)
    change = raw_phase.get("workload") or {}
    if not isinstance(change, dict):
        problems.append(f"{where}.workload: expected a mapping, got {change!r}")
        change = {}
    workload_raw = _merge(workload_raw, change)
    workload = parse_workload(workload_raw, f"{where}.workload", problems)
    phase_engine = _phase_engine(raw_phase, where, phase_engine, problems)
    note = raw_phase.get("note", "")
    story = parse_story(raw_phase.get("story"), f"{where}.story", problems)
    phase = Phase(phase_name, duration, workload, phase_engine, str(note), story) if workload is not None else None
    return phase, workload_raw, phase_engine


def _phase_duration(raw_phase: dict, where: str, problems: list[str]) -> float:
    try:
        # kvwatch's one duration grammar (kvwatch/units.py): 90, 90s, 3m, 500ms.
        duration = units.parse_duration(raw_phase.get("duration"))
    except ValueError:
        duration = None
    if duration is None:
        problems.append(
            f"{where}.duration: expected a positive number of seconds or a string like '90s', '3m', "
            f"got {raw_phase.get('duration')!r}"
        )
        duration = 1.0
    return duration


def _phase_engine(raw_phase: dict, where: str, phase_engine: EngineConfig, problems: list[str]) -> EngineConfig:
    """The engine of the phase before, with the settings a run may change changed."""
    engine_change = raw_phase.get("engine") or {}
    if not isinstance(engine_change, dict):
        problems.append(f"{where}.engine: expected a mapping, got {engine_change!r}")
        engine_change = {}
    for key in engine_change:
        if key not in EngineConfig.RUNTIME_FIELDS:
            problems.append(
                f"{where}.engine.{key}: cannot change during a run "
                f"(a phase may change {', '.join(EngineConfig.RUNTIME_FIELDS)})"
            )
    phase_engine = replace(phase_engine, **{k: v for k, v in engine_change.items() if k in EngineConfig.RUNTIME_FIELDS})
    if engine_change:
        problems.extend(phase_engine.problems(f"{where}.engine"))
    return phase_engine


def _builtin_dir():
    return resources.files("kvwatch").joinpath("scenarios")


def list_scenarios() -> list[tuple[str, str]]:
    """(name, first line of description) of every shipped scenario."""
    out = []
    for entry in sorted(_builtin_dir().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            try:
                data = yaml.safe_load(entry.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError:
                data = {}
            description = str(data.get("description", "")).strip().splitlines()
            out.append((entry.name[: -len(".yaml")], description[0] if description else ""))
    return out


# A scenario file is a few KiB; a path to /dev/zero or a FIFO must not hang.
MAX_SCENARIO_BYTES = 1024 * 1024


def is_scenario_path(name_or_path: str | Path) -> bool:
    """Whether the text names a file of the user's (a slash, or a .yaml or
    .yml ending) rather than a shipped scenario: a bare name is always the
    package's, so a `demo/` folder or a file `healthy` in the current
    directory never shadows one."""
    source = str(name_or_path)
    return isinstance(name_or_path, Path) or "/" in source or os.sep in source \
        or source.endswith((".yaml", ".yml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A shipped scenario by name (`healthy`), or a YAML file by path."""
    text = None
    source = str(name_or_path)
    if is_scenario_path(name_or_path):
        try:
            text = units.read_small_file(source, MAX_SCENARIO_BYTES).decode("utf-8")
        except FileNotFoundError:
            raise ScenarioError(source, [f"no such scenario file: {source}"]) from None
        except OSError as exc:
            raise ScenarioError(source, [f"cannot read it: {exc.strerror or exc}"]) from None
        except UnicodeDecodeError as exc:
            raise ScenarioError(source, [f"not UTF-8 text (byte {exc.start})"]) from None
        except ValueError as exc:
            raise ScenarioError(source, [str(exc)]) from None
    else:
        entry = _builtin_dir().joinpath(f"{source}.yaml")
        if not entry.is_file():
            names = ", ".join(name for name, _ in list_scenarios())
            raise ScenarioError(source, [f"no shipped scenario named {source!r} (shipped: {names})"])
        text = entry.read_text(encoding="utf-8")
        source = f"{source} (kvwatch/scenarios/{source}.yaml)"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(source, [f"not valid YAML: {units.yaml_problem(exc)}"]) from None
    return parse_scenario(data, source)
