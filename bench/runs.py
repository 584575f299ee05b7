"""Repeated runs of one benchmark row: the row shows its median run, and lists every run's
figure beside it. On a shared machine one run of a row can be far off the others."""

from __future__ import annotations


def median_run(runs: list[dict], key: str) -> dict:
    """The run with the median ``key`` (the lower one of an even count), with every run's
    ``key`` in ``{key}_runs``, in the order they ran; a single run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    ranked = sorted(runs, key=lambda row: row.get(key) or 0.0)
    return {**ranked[(len(runs) - 1) // 2], f"{key}_runs": [row.get(key) for row in runs]}
