"""KVWATCH_TEST_SHUFFLE: the suite in a shuffled order that its seed repeats
(tests/conftest.py), so a test that passes only after another shows."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import shuffle_seed, shuffled


def items(modules: int = 6, tests: int = 5) -> list:
    return [SimpleNamespace(path=Path(f"tests/test_{m}.py"), name=f"test_{m}_{t}")
            for m in range(modules) for t in range(tests)]


def names(order: list) -> list[str]:
    return [item.name for item in order]


def test_a_seed_repeats_its_order_and_another_seed_gives_another():
    collected = items()
    first = shuffled(collected, 7)
    assert names(first) == names(shuffled(collected, 7))
    assert names(first) != names(shuffled(collected, 8))
    assert names(first) != names(collected)
    assert sorted(names(first)) == sorted(names(collected))  # every test once


def test_each_modules_tests_stay_together_so_its_fixtures_start_once():
    order = shuffled(items(), 3)
    modules = [item.path for item in order]
    runs = [path for i, path in enumerate(modules) if i == 0 or modules[i - 1] != path]
    assert len(runs) == len(set(modules)) == 6
    assert runs != sorted(runs)  # the modules' order changed too


@pytest.mark.parametrize("value, seed", [(None, None), ("", None), ("  ", None), ("42", 42), (" 7 ", 7)])
def test_the_variable_names_the_seed(value, seed):
    assert shuffle_seed(value) == seed


def test_random_picks_a_seed_and_anything_else_is_one_sentence():
    assert isinstance(shuffle_seed("random"), int)
    with pytest.raises(pytest.UsageError, match="must be a whole number .* or 'random', not 'soon'"):
        shuffle_seed("soon")
