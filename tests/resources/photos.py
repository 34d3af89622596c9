"""Real photos for image tests and benchmarks: JPEGs cut from the sample photos scikit-learn ships
(``china.jpg`` and ``flower.jpg``, 427 x 640 each), nothing downloaded.

``photos(n, seed)`` gives ``n`` JPEG files' bytes, each a random region of 300-427 x 350-640
pixels of one of the photos (so about 40-60 KiB at quality 90), deterministic for ``seed``.
"""

from __future__ import annotations

import io

import numpy as np


def photos(n: int, seed: int = 0, quality: int = 90) -> list[bytes]:
    """``n`` JPEGs cut from scikit-learn's sample photos."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    sources = load_sample_images().images
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        src = sources[i % len(sources)]
        h, w = int(rng.integers(300, 428)), int(rng.integers(350, 641))
        y, x = int(rng.integers(0, src.shape[0] - h + 1)), int(rng.integers(0, src.shape[1] - w + 1))
        buf = io.BytesIO()
        Image.fromarray(src[y : y + h, x : x + w]).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out
