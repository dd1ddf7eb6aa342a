"""Benchmarks: speed as ratios against native vLLM or TransformerLens in the same run (docs/benchmarks.md)."""
import json


def write_result(result: dict, path: str | None) -> None:
    """A run's JSON (command, machine, versions, every repeat) at `path`, if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=_plain)


def _plain(value):
    """A numpy scalar (vLLM's results and numpy's comparisons hold them) as the Python number it is."""
    return value.item()
