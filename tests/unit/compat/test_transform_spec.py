"""Petastorm's ``TransformSpec`` in sparkdl's converter, as the image tutorials use it: a pandas
function that decodes and augments each photo with PIL, declared fields, selected fields. Without
Spark: the converter over Parquet files written with pyarrow (what make_spark_converter writes is
tested in tests/integration/test_petastorm_converter.py). The function runs on decode processes
with each row's own random draws, so its output does not depend on the workers or the batch."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from resources.photos import photos

from sparkdl import ConfigError, DatasetError
from sparkdl.compat.petastorm import SparkDatasetConverter, TransformSpec

N = 24


def _converter(path: Path, contents: list[bytes]) -> SparkDatasetConverter:
    path.mkdir(parents=True, exist_ok=True)
    table = pa.table({"content": pa.array(contents, pa.binary()), "label": pa.array(np.arange(len(contents)) % 3)})
    pq.write_table(table, path / "part-0.parquet", row_group_size=8)
    return SparkDatasetConverter(f"file://{path}", [f"file://{path}/part-0.parquet"], len(contents))


@pytest.fixture(scope="module")
def converter(tmp_path_factory: pytest.TempPathFactory) -> SparkDatasetConverter:
    return _converter(tmp_path_factory.mktemp("photos"), photos(N, seed=7))


def augment(pdf: Any) -> Any:
    """The tutorial's function: decode, random crop and flip with PIL, CHW float32 in [0, 1]."""
    from PIL import Image

    def one(data: bytes) -> np.ndarray:
        im = Image.open(io.BytesIO(data)).convert("RGB").resize((40, 40))
        x, y = random.randint(0, 8), random.randint(0, 8)  # Python's generator, as many tutorials draw
        im = im.crop((x, y, x + 32, y + 32))
        if np.random.rand() < 0.5:  # and numpy's
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return (np.asarray(im, np.float32) / 255.0).transpose(2, 0, 1)

    pdf["features"] = pdf["content"].map(one)
    return pdf


SPEC = TransformSpec(augment, edit_fields=[("features", np.float32, (3, 32, 32), False)],
                     selected_fields=["features", "label"])


def _by_label(converter: SparkDatasetConverter, **kwargs: Any) -> dict[int, list[torch.Tensor]]:
    out: dict[int, list[torch.Tensor]] = {}
    with converter.make_torch_dataloader(batch_size=5, num_epochs=1, transform_spec=SPEC, **kwargs) as loader:
        for batch in loader:
            assert list(batch) == ["features", "label"]
            assert batch["features"].dtype == torch.float32 and batch["features"].shape[1:] == (3, 32, 32)
            assert batch["label"].dtype == torch.int64 and batch["label"].dim() == 1  # a scalar field: 1-D
            for label, img in zip(batch["label"].tolist(), batch["features"], strict=True):
                out.setdefault(label, []).append(img)
    return out


def test_the_tutorials_transform_spec_feeds_selected_fields_with_each_rows_own_augmentation(converter: SparkDatasetConverter) -> None:
    one = _by_label(converter, cur_shard=0, shard_count=1, workers_count=1)
    assert sum(len(v) for v in one.values()) == N
    # Another shuffle order and batch composition: every row's augmentation is the same.
    again = _by_label(converter, cur_shard=0, shard_count=1, seed=0, shuffle_rows=True)
    for label, imgs in one.items():
        assert sorted(float(i.sum()) for i in imgs) == pytest.approx(sorted(float(i.sum()) for i in again[label]))
    # The draws are real: not every row came out cropped and flipped alike.
    sums = sorted(float(i[:, :, :4].sum()) for imgs in one.values() for i in imgs)
    assert len(set(sums)) > N // 2
    # Two shards: every row once, each with the augmentation it had alone.
    halves = [_by_label(converter, cur_shard=r, shard_count=2) for r in (0, 1)]
    assert sum(len(v) for h in halves for v in h.values()) == N


def test_a_declared_field_that_func_returns_otherwise_is_named_with_both_shapes(converter: SparkDatasetConverter) -> None:
    wrong = TransformSpec(augment, edit_fields=[("features", np.float32, (3, 64, 64), False)], selected_fields=["features"])
    with pytest.raises(ConfigError, match=r"field 'features' is declared of shape \(3, 64, 64\); func returned shape \(3, 32, 32\)"), \
            converter.make_torch_dataloader(batch_size=4, num_epochs=1, transform_spec=wrong) as loader:
        next(iter(loader))
    dtype = TransformSpec(augment, edit_fields=[("features", np.uint8, (3, 32, 32), False)], selected_fields=["features"])
    with pytest.raises(ConfigError, match=r"field 'features' is declared uint8 .*; func returned float32"), \
            converter.make_torch_dataloader(batch_size=4, num_epochs=1, transform_spec=dtype) as loader:
        next(iter(loader))


def test_a_row_func_fails_on_is_named_or_skipped(tmp_path: Path) -> None:
    contents = photos(10, seed=3)
    contents[4] = b"not a photo"
    conv = _converter(tmp_path / "bad", contents)
    with pytest.raises(DatasetError, match=r"row 4 .*UnidentifiedImageError"), \
            conv.make_torch_dataloader(batch_size=5, num_epochs=1, transform_spec=SPEC, shuffle_row_groups=False) as loader:
        list(loader)
    with conv.make_torch_dataloader(batch_size=5, num_epochs=1, transform_spec=SPEC, shuffle_row_groups=False,
                                    on_bad_sample="skip") as loader:
        sizes = [len(b["label"]) for b in loader]
    assert sizes == [4, 5]


def test_a_spec_of_petastorms_own_shape_is_taken(converter: SparkDatasetConverter) -> None:
    class TheirSpec:  # what petastorm.TransformSpec holds (the classic stack runs the real one)
        def __init__(self) -> None:
            self.func, self.edit_fields = augment, [("features", np.float32, (3, 32, 32), False)]
            self.removed_fields, self.selected_fields = ["content"], None

    with converter.make_torch_dataloader(batch_size=6, num_epochs=1, transform_spec=TheirSpec()) as loader:
        batch = next(iter(loader))
    assert sorted(batch) == ["features", "label"] and batch["features"].shape == (6, 3, 32, 32)
    with pytest.raises(ConfigError, match="removed_fields or selected_fields, not both"):
        TransformSpec(augment, removed_fields=["a"], selected_fields=["b"])


def test_a_func_that_draws_nothing_runs_on_many_rows_at_once_and_gives_each_rows_own_output() -> None:
    """Per-row calls cost a DataFrame a row; a func that draws nothing from the global generators
    is called on the decode chunk's rows at once, and must give exactly the per-row outputs.
    A func that draws (here on one row only) is caught and run row by row, each row seeded."""
    from sparkdl._internal.data.decoding.row_transform import RowTransform, from_petastorm
    from sparkdl._internal.data.decoding.samples import sample_rng

    calls: list[int] = []

    def double(pdf: Any) -> Any:
        calls.append(len(pdf))
        pdf["y"] = pdf["x"] * 2
        return pdf

    def noisy_on_two(pdf: Any) -> Any:
        calls.append(len(pdf))
        pdf["y"] = [x + (random.random() if x == 2 else 0.0) for x in pdf["x"]]
        if 5 in set(pdf["x"]):
            raise ValueError("row 5 is broken")
        return pdf

    rows = [{"x": float(i)} for i in range(6)]

    def names(results: list[Any]) -> list[Any]:
        return [type(r).__name__ if isinstance(r, Exception) else r for r in results]

    for func in (double, noisy_on_two):
        spec = from_petastorm(TransformSpec(func, edit_fields=[("y", np.float64, (), False)]))
        transform = RowTransform(spec)  # one decode worker's
        calls.clear()
        first = transform.run_chunk(rows, [sample_rng(0, 0, i) for i in range(6)])
        second = transform.run_chunk(rows, [sample_rng(0, 0, i) for i in range(6)])
        chunk_calls = list(calls)
        one_by_one = []
        for i, row in enumerate(rows):
            try:
                one_by_one.append(RowTransform(spec)(dict(row), sample_rng(0, 0, i)))
            except ValueError as exc:
                one_by_one.append(exc)
        assert names(first) == names(one_by_one) and names(second) == names(one_by_one)
        if func is double:
            assert chunk_calls == [6, 6] and not transform._draws  # one call a chunk
        else:  # the first chunk's call drew: discarded, each row alone, seeded; the next chunk too
            assert chunk_calls == [6] + [1] * 6 + [1] * 6 and transform._draws, chunk_calls
            assert isinstance(first[5], ValueError) and first[2]["y"] != 2.0 and first[1]["y"] == 1.0
