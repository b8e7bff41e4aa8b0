"""benchmarks/RESULTS.md is whole and current: every section the benchmark
writes is there, each says the commit it was measured at (and the load),
and no commit after that one touched the code the section measures
(benchmarks/sections.py SECTION_CODE, asked of git), unless the file lists the
section under "## Not rerun" with the reason."""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest

from conftest import REPO

# Loaded from its file: benchmarks/ on sys.path would shadow tests/pageserver.py.
_spec = importlib.util.spec_from_file_location("bench_sections", REPO / "benchmarks" / "sections.py")
sections_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sections_module)

RESULTS = REPO / "benchmarks" / "RESULTS.md"
STAMP = re.compile(r"^Measured at commit ([0-9a-f]{7,40})(?: \(([^)]*)\))? on (\S+ \S+ \S+), load average at the "
                   r"start of the section (\d+\.\d\d \d+\.\d\d \d+\.\d\d);", re.M)


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def sections(text: str) -> dict[str, str]:
    """Each '### ' block of the details, by its heading."""
    blocks = re.split(r"^(?=### )", text, flags=re.M)
    return {block.split("\n", 1)[0]: block for block in blocks if block.startswith("### ")}


def not_rerun(text: str) -> dict[str, str]:
    """'## Not rerun' lines: `- section: why` (as benchmarks/run.py writes them)."""
    return sections_module.not_rerun_of(text)


def stale(section_commit: str, paths: tuple[str, ...]) -> list[str]:
    """The commits after `section_commit` that touched `paths` (oneline),
    bar those that only moved the code (sections.MOVED_WITHOUT_CHANGE)."""
    listed = git("log", "--format=%H %h %s", f"{section_commit}..HEAD", "--", *paths)
    assert listed.returncode == 0, listed.stderr
    moved = tuple(sections_module.MOVED_WITHOUT_CHANGE)
    return [line.split(" ", 1)[1] for line in listed.stdout.splitlines() if not line.startswith(moved)]


@pytest.fixture(scope="module")
def in_git():
    if git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("not a git checkout: the commits of the results cannot be compared")
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: the commits the results were measured at may not be in it")


def test_every_section_is_there_with_its_commit_and_load():
    text = RESULTS.read_text()
    blocks = sections(text)
    skipped = not_rerun(text)
    assert set(skipped) <= set(sections_module.SECTIONS), skipped
    for name in sections_module.SECTIONS:
        headings = [h for h in blocks if h.startswith(sections_module.SECTION_HEADINGS[name])]
        if name in skipped:
            assert skipped[name], f"{name}: listed as not rerun without a reason"
            continue
        assert headings, f"RESULTS.md has no section for {name} (run `benchmarks/run.py --only {name} --merge`)"
        for heading in headings:
            stamps = STAMP.findall(blocks[heading])
            assert len(stamps) == 1, f"{heading}: says no commit and load it was measured at"
            commit, modified, _date, _load = stamps[0]
            assert not modified, f"{heading}: measured with uncommitted changes ({modified})"


def test_no_section_is_older_than_the_code_it_measures(in_git):
    text = RESULTS.read_text()
    blocks = sections(text)
    skipped = not_rerun(text)
    problems = []
    for name in sections_module.SECTIONS:
        if name in skipped:
            continue
        for heading, block in blocks.items():
            if not heading.startswith(sections_module.SECTION_HEADINGS[name]):
                continue
            stamp = STAMP.search(block)
            if stamp is None:
                problems.append(f"{heading}: says no commit it was measured at")
                continue
            commit = stamp[1]
            known = git("cat-file", "-e", f"{commit}^{{commit}}")
            if known.returncode != 0:
                problems.append(f"{heading}: commit {commit} is not in this repository's history")
                continue
            if git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
                problems.append(f"{heading}: commit {commit} is not an ancestor of HEAD")
                continue
            later = stale(commit, sections_module.SECTION_CODE[name])
            if later:
                problems.append(f"{heading}: measured at {commit}, but {len(later)} later commits touch what it "
                                f"measures, the newest: {later[0]} (rerun `benchmarks/run.py --only {name} --merge`, "
                                "or list it under '## Not rerun' with the reason)")
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_section_older_than_its_code(in_git):
    """The check itself: the first commit of the history is older than the
    code of every section."""
    first = git("rev-list", "--max-parents=0", "HEAD").stdout.split()[-1]
    for name in sections_module.SECTIONS:
        assert stale(first, sections_module.SECTION_CODE[name]), name


def test_a_commit_that_only_moved_code_does_not_age_a_section(in_git):
    """Each commit listed as moving code without changing it is in the
    history, says what it moved, and is not counted against the paths it
    touched."""
    for commit, what in sections_module.MOVED_WITHOUT_CHANGE.items():
        assert what, f"{commit}: says nothing of what it moved"
        assert git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0, f"{commit}: not in this history"
        touched = git("diff-tree", "--no-commit-id", "--name-only", "-r", commit).stdout.split()
        assert touched, commit
        short = git("rev-parse", "--short", commit).stdout.strip()
        assert not [line for line in stale(f"{commit}^", tuple(touched)) if line.split()[0] == short], commit
