"""Write scikit-learn's bundled digits (1,797 8x8 images) as two ``.npz`` files to ingest.

    python examples/prepare_digits.py /tmp/digits-train.npz /tmp/digits-test.npz
    shardserve ingest /tmp/digits-train.npz --store store --name digits-train
    shardserve ingest /tmp/digits-test.npz  --store store --name digits-test

``image`` is float32[1, 8, 8] scaled to [0, 1], ``label`` int64. The split is fixed (a seeded
permutation, 80 % train), so every run evaluates on the same held-out samples.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All digits as (image float32[N,1,8,8] in [0,1], label int64[N])."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images.astype(np.float32) / 16.0)[:, None], d.target.astype(np.int64)


def split(seed: int = 0, train_fraction: float = 0.8) -> dict[str, dict[str, np.ndarray]]:
    image, label = digits_arrays()
    order = np.random.default_rng(seed).permutation(len(label))
    cut = int(len(label) * train_fraction)
    return {
        "train": {"image": image[order[:cut]], "label": label[order[:cut]]},
        "test": {"image": image[order[cut:]], "label": label[order[cut:]]},
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("train", type=Path, help="output .npz for the training split")
    p.add_argument(
        "test",
        type=Path,
        nargs="?",
        help="output .npz for the test split (default: TRAIN-test.npz)",
    )
    args = p.parse_args()
    test = args.test or args.train.with_name(args.train.stem + "-test.npz")
    parts = split()
    for path in (args.train, test):  # data/ of a fresh clone does not exist yet
        path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.train, **parts["train"])
    np.savez(test, **parts["test"])
    print(
        f"wrote {args.train} ({len(parts['train']['label'])} samples) and {test} ({len(parts['test']['label'])})"
    )


if __name__ == "__main__":
    main()
