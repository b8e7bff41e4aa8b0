"""A model's config.json read from disk, a file or the folder holding it: the
one reader behind `kvwatch capacity --model-config` and `kvwatch sweep
--model-config`. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvwatch.capacity.arithmetic import CapacityInputError


def load_model_config(path_text: str) -> dict[str, Any]:
    """The config's fields; CapacityInputError says why they cannot be read."""
    path = Path(path_text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CapacityInputError(f"model config not found: {path}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise CapacityInputError(f"cannot read {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise CapacityInputError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise CapacityInputError(f"{path} holds JSON but not an object of model fields")
    return config
