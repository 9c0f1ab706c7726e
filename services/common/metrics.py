"""Combining metric reports of the same kind taken over different windows."""

from __future__ import annotations

# Keys that are averages over samples (weighted when combined); every other key is a count
# or a duration (summed).
AVERAGE_SUFFIXES = ("_mean", "_ratio")


def merge_sample_metrics(total: dict[str, float], more: dict[str, float], samples_key: str) -> None:
    """Add report `more` to `total` in place: averages weighted by their samples (the value
    at `samples_key`, itself summed), everything else summed."""
    n_total, n_more = total.get(samples_key, 0.0), more.get(samples_key, 0.0)
    for key, value in more.items():
        if key.endswith(AVERAGE_SUFFIXES):
            if n_total + n_more:
                total[key] = (total.get(key, 0.0) * n_total + value * n_more) / (n_total + n_more)
        else:
            total[key] = total.get(key, 0.0) + value
