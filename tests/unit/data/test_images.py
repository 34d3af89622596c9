"""Images in the loader, without a JVM: real photos (scikit-learn's) in Parquet written with pyarrow,
decoded by ``decode={...}`` on threads and processes; what users rely on: the same pixels for the
same seed whatever the workers, resume, RGB from every mode, bad samples named or skipped."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from resources.photos import photos

import sparkdl
from sparkdl import ConfigError, Dataset, DatasetError, ImageDecoder

N = 72
SMALL = ImageDecoder(48)  # small outputs keep the tests fast; the draws are those of any size


def _write(path: Path, contents: list[bytes | None], *, row_group: int = 16, files: int = 2) -> Dataset:
    path.mkdir(parents=True, exist_ok=True)
    n = len(contents)
    cut = np.array_split(np.arange(n), files)
    for k, ids in enumerate(cut):
        table = pa.table({
            "content": pa.array([contents[i] for i in ids], pa.binary()),
            "label": pa.array(ids, pa.int64()),
            "path": pa.array([f"/photos/img_{i}.jpg" for i in ids]),
        })
        pq.write_table(table, path / f"part-{k}.parquet", row_group_size=row_group)
    return Dataset(str(path))


@pytest.fixture(scope="module")
def photo_ds(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return _write(tmp_path_factory.mktemp("photos"), list(photos(N, seed=4)))


def _by_label(loader: sparkdl._internal.data.loader.Loader) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for batch in loader:
        for label, img in zip(batch["label"].tolist(), batch["content"], strict=True):
            out.setdefault(label, img)
    return out


def test_same_pixels_for_any_number_and_kind_of_workers_and_the_plain_loaders_batches(photo_ds: Dataset) -> None:
    plain = [b["label"] for b in photo_ds.loader(10, seed=3)]
    runs = []
    for workers, kind in ((1, "threads"), (3, "threads"), (2, "processes")):
        loader = photo_ds.loader(10, seed=3, decode={"content": SMALL}, decode_workers=workers, decode_in=kind)
        runs.append(list(loader))
        loader.close()
    first = runs[0]
    assert [b["label"].tolist() for b in first] == [p.tolist() for p in plain]  # same batches, same order
    assert first[0]["content"].dtype == torch.uint8 and first[0]["content"].shape == (10, 3, 48, 48)
    assert first[-1]["content"].shape[0] == len(plain[-1])
    assert first[0]["path"][0].startswith("/photos/")  # other columns as the plain loader gives them
    for other in runs[1:]:
        assert len(other) == len(first)
        for a, b in zip(first, other, strict=True):
            assert torch.equal(a["content"], b["content"])


def test_images_decoded_in_loader_workers_are_the_threads_pixels(photo_ds: Dataset) -> None:
    threads = list(photo_ds.loader(10, seed=3, decode={"content": SMALL}))
    loader = photo_ds.loader(10, seed=3, decode={"content": SMALL}, workers=2)
    with loader:
        procs = list(loader)
    assert len(procs) == len(threads)
    for a, b in zip(threads, procs, strict=True):
        assert torch.equal(a["content"], b["content"]) and torch.equal(a["label"], b["label"]) and a["path"] == b["path"]


def test_randomness_is_the_samples_own_epoch_seed_and_row(photo_ds: Dataset) -> None:
    e0 = _by_label(photo_ds.loader(8, seed=1, decode={"content": SMALL}))
    again = _by_label(photo_ds.loader(8, seed=1, decode={"content": SMALL}, shuffle=False, world_size=3, rank=1))
    assert again and all(torch.equal(img, e0[label]) for label, img in again.items())  # order, rank: no matter
    e1 = _by_label(photo_ds.loader(8, seed=1, epoch=1, decode={"content": SMALL}))
    other_seed = _by_label(photo_ds.loader(8, seed=2, decode={"content": SMALL}))
    assert sum(not torch.equal(e1[k], e0[k]) for k in e0) > N // 2
    assert sum(not torch.equal(other_seed[k], e0[k]) for k in e0) > N // 2


def test_resume_mid_epoch_gives_the_same_augmented_pixels_also_at_another_world_size(photo_ds: Dataset) -> None:
    whole = photo_ds.loader(6, seed=5, world_size=2, rank=0, decode={"content": SMALL})
    batches = list(whole)
    cut = photo_ds.loader(6, seed=5, world_size=2, rank=0, decode={"content": SMALL}, decode_workers=1)
    it = iter(cut)
    for _ in range(2):
        next(it)
    state = cut.state_dict()
    cut.close()
    resumed = photo_ds.loader(6, seed=5, world_size=2, rank=0, decode={"content": SMALL})
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(batches) - 2
    for a, b in zip(batches[2:], rest, strict=True):
        assert torch.equal(a["label"], b["label"]) and torch.equal(a["content"], b["content"])
    # At world size 1 the rest of the epoch is another order of rows, each with its own pixels.
    reference = _by_label(photo_ds.loader(6, seed=5, decode={"content": SMALL}))
    one = photo_ds.loader(6, seed=5, world_size=1, rank=0, decode={"content": SMALL})
    one.load_state_dict(state)
    seen = _by_label(one)
    assert seen and all(torch.equal(img, reference[label]) for label, img in seen.items())


def test_crop_full_is_the_whole_image_resized_and_flips_mirror(tmp_path: Path) -> None:
    data = photos(1, seed=9)[0]
    image = Image.open(io.BytesIO(data)).convert("RGB")
    for size, scaled in (((200, 280), False), ((40, 56), True)):
        full = ImageDecoder(size, crop="full")(data, np.random.default_rng(0))
        want = np.asarray(image.resize(size[::-1], Image.Resampling.BILINEAR)).transpose(2, 0, 1)
        assert full.shape == (3, *size) and full.dtype == np.uint8
        if not scaled:  # Pillow's own bilinear resize, to within a level (torch's kernel)
            assert np.abs(full.astype(int) - want.astype(int)).max() <= 1
        else:  # decoded at 1/8 scale in the DCT domain (a box filter) before the bilinear resize
            assert np.abs(full.astype(int) - want.astype(int)).mean() < 10
    flips = [seed for seed in range(40) if ImageDecoder(32).region(400, 300, np.random.default_rng(seed))[4]]
    assert 8 < len(flips) < 32
    seed = flips[0]
    a = ImageDecoder(32, flip=True)(data, np.random.default_rng(seed))
    b = ImageDecoder(32, flip=False)(data, np.random.default_rng(seed))
    assert np.array_equal(a, b[:, :, ::-1])


def test_random_regions_keep_scale_and_ratio() -> None:
    dec = ImageDecoder(224, scale=(0.2, 0.5), ratio=(0.5, 2.0))
    for seed in range(200):
        x, y, w, h, _ = dec.region(640, 427, np.random.default_rng(seed))
        assert x >= 0 and x + w <= 640 and y >= 0 and y + h <= 427
        assert 0.19 <= w * h / (640 * 427) <= 0.51 and 0.49 <= w / h <= 2.05
    x, y, w, h, flip = ImageDecoder(100, crop="center").region(400, 200, np.random.default_rng(0))
    assert (w, h, flip) == (175, 175, False) and (x, y) == (112, 12)


def _encoded(mode: str, fmt: str, color: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (30, 20), color).save(buf, format=fmt, **({"quality": 100} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.mark.parametrize(("mode", "fmt", "color", "rgb"), [
    ("RGBA", "PNG", (200, 40, 10, 0), (200, 40, 10)),     # alpha dropped
    ("L", "JPEG", (90,), (90, 90, 90)),                    # grayscale
    ("CMYK", "JPEG", (0, 255, 255, 0), (255, 0, 0)),        # CMYK red
    ("P", "GIF", 3, None),                                  # a palette
    ("I;16", "PNG", (0x8000,), (128, 128, 128)),            # 16-bit gray: its top 8 bits
])
def test_every_mode_comes_out_rgb(mode: str, fmt: str, color: object, rgb: tuple[int, ...] | None) -> None:
    out = ImageDecoder((10, 15), crop="full")(_encoded(mode, fmt, color), np.random.default_rng(0))  # type: ignore[arg-type]
    assert out.shape == (3, 10, 15) and out.dtype == np.uint8
    if rgb is not None:
        assert np.abs(out.reshape(3, -1).mean(axis=1) - np.array(rgb)).max() <= 3


def test_a_spark_image_struct_is_bgr_pixels() -> None:
    h, w = 6, 9
    bgr = np.zeros((h, w, 3), np.uint8)
    bgr[..., 0], bgr[..., 2] = 255, 7  # blue 255, red 7 in OpenCV's order
    row = {"origin": "file:/x.png", "height": h, "width": w, "nChannels": 3, "mode": 16, "data": bgr.tobytes()}
    out = ImageDecoder((h, w), crop="full")(row, np.random.default_rng(0))
    assert (out[0] == 7).all() and (out[1] == 0).all() and (out[2] == 255).all()
    with pytest.raises(sparkdl._internal.data.decoding.images.BadImage, match="could not read"):
        SMALL({**row, "height": -1, "width": -1, "data": b""}, np.random.default_rng(0))


def _bad_samples() -> dict[int, bytes]:
    good = photos(2, seed=1)
    return {5: good[0][: len(good[0]) // 3], 11: b"", 20: b"not an image at all", 21: good[1]}


def test_a_bad_sample_is_named_with_its_row_file_and_path(tmp_path: Path) -> None:
    contents: list[bytes | None] = list(photos(24, seed=2))
    for i, data in _bad_samples().items():
        contents[i] = data
    ds = _write(tmp_path / "bad", contents, files=1)
    with pytest.raises(DatasetError) as err:
        list(ds.loader(8, shuffle=False, decode={"content": SMALL}))
    message = str(err.value)
    assert "column 'content', row 5 (row 5 of part-0.parquet, path='/photos/img_5.jpg')" in message
    assert "on_bad_sample='skip'" in message
    with pytest.raises(DatasetError, match=r"row 20 \(row 20 of part-0.parquet, path=.*not an image in a format sparkdl decodes"):
        list(ds.loader(8, shuffle=False, decode={"content": SMALL}, rank=1, world_size=2))
    with pytest.raises(sparkdl._internal.data.decoding.images.BadImage, match=r"empty \(0 bytes\)"):
        SMALL(b"", np.random.default_rng(0))
    bomb = ds.loader(8, shuffle=False, decode={"content": ImageDecoder(48, max_pixels=100_000)})
    with pytest.raises(DatasetError, match="max_pixels=100000"):
        list(bomb)


def test_skip_leaves_bad_rows_out_counts_them_and_keeps_the_steps(tmp_path: Path) -> None:
    contents: list[bytes | None] = list(photos(24, seed=2))
    bad = _bad_samples()
    for i, data in bad.items():
        contents[i] = data
    ds = _write(tmp_path / "skip", contents, files=1)
    loader = ds.loader(8, shuffle=False, decode={"content": SMALL}, on_bad_sample="skip", decode_workers=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 3
    labels = [label for b in batches for label in b["label"].tolist()]
    assert labels == [i for i in range(24) if i not in (5, 11, 20)]  # 21 is a good photo
    for b in batches:
        assert len(b["content"]) == len(b["label"]) == len(b["path"])
    assert loader.skipped == 3


def test_decoder_processes_end_with_the_loader(photo_ds: Dataset) -> None:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    loader = photo_ds.loader(16, decode={"content": SMALL}, decode_in="processes", decode_workers=2)
    workers = {p.pid for p in me.children(recursive=True)} - before
    assert len(workers) == 2  # forked when the loader is made
    next(iter(loader))
    loader.close()
    assert not {p.pid for p in me.children(recursive=True) if p.is_running()} - before
    again = iter(loader)  # iterating again forks them again, here, and goes on from step 1
    assert len({p.pid for p in me.children(recursive=True)} - before) == 2
    reference = list(photo_ds.loader(16, decode={"content": SMALL}))
    assert torch.equal(next(again)["content"], reference[1]["content"])
    loader.close()
    assert not {p.pid for p in me.children(recursive=True) if p.is_running()} - before


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"decode": ["content"]}, "decode must be a mapping of column names"),
    ({"decode": {"content": 3}}, r"decode\['content'\] must be callable"),
    ({"decode": {"content": SMALL}, "decode_in": "fibers"}, r"decode_in must be one of 'threads' .*; got 'fibers'"),
    ({"decode": {"content": SMALL}, "decode_workers": 0}, r"decode_workers must be an integer >= 1 or None.*; got 0"),
    ({"decode": {"content": SMALL}, "on_bad_sample": "ignore"}, r"on_bad_sample must be one of 'raise' .*'skip' .*; got 'ignore'"),
    ({"decode": {"content": SMALL}, "reader": "petastorm"}, "needs reader='arrow'"),
    ({"decode": {"content": SMALL}, "columns": ["label"]}, r"decode names \['content'\]"),
])
def test_bad_settings_name_themselves(photo_ds: Dataset, kwargs: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        photo_ds.loader(8, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"size": 0}, "ImageDecoder.size must be .*; got 0"), ({"crop": "corner"}, "ImageDecoder.crop must be .*; got 'corner'"),
    ({"scale": (0.5, 0.1)}, r"ImageDecoder.scale must be .*; got \(0.5, 0.1\)"), ({"ratio": (0, 1)}, r"ImageDecoder.ratio must be .*; got \(0, 1\)"),
    ({"max_pixels": 0}, "ImageDecoder.max_pixels must be .*; got 0"), ({"device": "tpu"}, "ImageDecoder.device must be .*; got 'tpu'"),
])
def test_image_decoder_settings_are_checked(kwargs: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        ImageDecoder(**kwargs)  # type: ignore[arg-type]


def test_the_batched_path_crops_and_flips_like_the_per_sample_path(photo_ds: Dataset) -> None:
    """``ImageDecoder(device=...)`` decodes a batch at once and crops it in one sampling pass (nvJPEG
    and the GPU on CUDA; here the same code on the CPU): the same regions and flips as the per-sample
    decoder, the pixels within a few levels, bad samples named the same way."""
    per_sample = photo_ds.loader(12, seed=6, decode={"content": ImageDecoder(160)})  # no DCT scaling at 160
    batched = photo_ds.loader(12, seed=6, decode={"content": ImageDecoder(160, device="cpu")})
    for a, b in zip(per_sample, batched, strict=True):
        assert b["content"].dtype == torch.uint8 and b["content"].shape == a["content"].shape
        # The filters differ (a box of k x k bilinear samples against Pillow's triangle) by a few
        # levels on fine detail; 8 x 8 averages show the geometry alone: same region, same flip.
        x, y = a["content"].float(), b["content"].float()
        assert (x - y).abs().mean(dim=(1, 2, 3)).max() < 10
        coarse = torch.nn.functional.avg_pool2d
        diff = (coarse(x, 8) - coarse(y, 8)).abs().mean(dim=(1, 2, 3))
        mirrored = (coarse(x, 8) - coarse(y.flip(-1), 8)).abs().mean(dim=(1, 2, 3))
        assert diff.max() < 2 and (mirrored > 3 * diff).all()
    contents: list[bytes | None] = list(photos(8, seed=2))
    contents[3] = b"GIF89a broken"
    out, bad = ImageDecoder(32, device="cpu").decode_batch(contents, [np.random.default_rng(i) for i in range(8)])
    assert list(bad) == [3] and out[3] is None and all(o is not None and o.shape == (3, 32, 32) for i, o in enumerate(out) if i != 3)
