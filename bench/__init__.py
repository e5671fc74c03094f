"""Benchmarks: each prints JSON lines and measures its baseline in the same run."""

import argparse

PUT_MODES = ("visible", "cached")


def put_modes(text: str) -> list[str]:
    """``--put-modes``: a comma-separated list of put modes (argparse's ``type``), in order, at least one."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or set(modes) - set(PUT_MODES):
        raise argparse.ArgumentTypeError(f"{' and/or '.join(PUT_MODES)}, not {text!r}")
    return modes
