"""Images from Spark's own sources to torch: ``binaryFile`` and ``image`` DataFrames through
``write_dataset``, decoded by the loader; and a gang SIGKILLed mid-epoch that resumes with the very
augmented pixels of an uninterrupted run (TrainState, 2 ranks)."""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from PIL import Image
from resources.photos import photos

import sparkdl
from sparkdl import DatasetError, ImageDecoder

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = sparkdl.RunConfig(start_timeout_s=90, slot_wait_s=30, collective_timeout_s=6.0, kill_grace_s=30)
N = 48


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real photos as files, in class folders (the label comes from the path), one PNG among them."""
    root = tmp_path_factory.mktemp("photos")
    for i, data in enumerate(photos(N, seed=8)):
        folder = root / ("cat" if i % 2 else "dog")
        folder.mkdir(exist_ok=True)
        if i == 7:
            Image.open(io.BytesIO(data)).save(folder / f"img_{i:03d}.png")
        else:
            (folder / f"img_{i:03d}.jpg").write_bytes(data)
    return root


def _read(spark: Any, source: str, folder: Path) -> Any:
    return spark.read.format(source).option("recursiveFileLookup", "true").load(str(folder))


def _labelled(spark: Any, df: Any, path_col: str) -> Any:
    from pyspark.sql import functions as F

    return df.withColumn("label", (F.element_at(F.split(path_col, "/"), -2) == "cat").cast("long"))


def test_binary_files_from_spark_feed_decoded_batches_and_a_corrupt_file_is_named(spark: Any, image_dir: Path,
                                                                                  tmp_path: Path) -> None:
    df = _labelled(spark, _read(spark, "binaryFile", image_dir), "path")
    ds = sparkdl.write_dataset(df, str(tmp_path / "binary"))  # path, modificationTime, length, content, label
    loader = ds.loader(16, columns=["content", "label", "path"], decode={"content": ImageDecoder(32)}, seed=1)
    batches = list(loader)
    assert len(batches) == len(loader) == N // 16
    assert all(b["content"].shape == (16, 3, 32, 32) and b["content"].dtype == torch.uint8 for b in batches)
    for b in batches:  # the labels derived in Spark travel with their images
        assert [int(p.split("/")[-2] == "cat") for p in b["path"]] == b["label"].tolist()
    (image_dir / "dog" / "img_000.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    try:
        bad = _labelled(spark, _read(spark, "binaryFile", image_dir), "path")
        ds2 = sparkdl.write_dataset(bad, str(tmp_path / "bad"))
        with pytest.raises(DatasetError, match=r"column 'content', row \d+ \(row \d+ of .*\.parquet, path='file:.*/dog/img_000\.jpg'\)"):
            list(ds2.loader(16, columns=["content", "path"], decode={"content": ImageDecoder(32)}))
        skipping = ds2.loader(16, columns=["content", "label"], decode={"content": ImageDecoder(32)}, on_bad_sample="skip")
        assert sum(len(b["label"]) for b in skipping) == N - 1 and skipping.skipped == 1
    finally:
        (image_dir / "dog" / "img_000.jpg").write_bytes(photos(1, seed=8)[0])


def test_spark_image_source_structs_decode_to_the_same_pixels_as_the_files(spark: Any, image_dir: Path,
                                                                           tmp_path: Path) -> None:
    df = _read(spark, "image", image_dir)  # struct: origin, height, width, nChannels, mode, data
    ds = sparkdl.write_dataset(df.select("image", "image.origin"), str(tmp_path / "structs"))
    full = ImageDecoder((150, 170), crop="full")  # no smaller than half of any photo: decoded at full scale
    batch = next(iter(ds.loader(N, decode={"image": full}, shuffle=False)))
    assert batch["image"].shape == (N, 3, 150, 170)
    # Spark decoded with Java's ImageIO into BGR; ours decodes the files themselves: the same
    # pixels, in RGB order, to within what two JPEG decoders differ by.
    files = sparkdl.write_dataset(_read(spark, "binaryFile", image_dir), str(tmp_path / "files"))
    def name(url: str) -> str:  # Spark writes file:/ in one source and file:/// in the other
        return "/".join(url.split("/")[-2:])

    by_name = {name(p): img
               for b in files.loader(N, shuffle=False, columns=["content", "path"], decode={"content": full})
               for p, img in zip(b["path"], b["content"], strict=True)}
    origins = [name(o) for o in batch["origin"]]
    assert sorted(origins) == sorted(by_name) and len(origins) == N
    for origin, img in zip(origins, batch["image"], strict=True):
        mine = by_name[origin].int()
        off = (img.int() - mine).abs().float().mean()
        swapped = (img.int().flip(0) - mine).abs().float().mean()  # as if BGR were taken for RGB
        assert off < 6 and swapped > 2 * off  # Java's JPEG decoder is not libjpeg-turbo: a few levels


def _train_on_images(ds: sparkdl.Dataset, kill: dict[str, int]) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = sparkdl.context()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 5, stride=4), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 7 * 7, 2))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = ds.loader(6, seed=11, drop_last=True, columns=["content", "label"],
                       decode={"content": ImageDecoder(32)}, decode_workers=2)
    state = sparkdl.TrainState(model, opt, loader)
    seen = []
    for batch in state.batches(epochs=2, save_every=2):
        if ctx.attempt == 0 and ctx.rank == kill["rank"] and state.global_step == kill["step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        x = batch["content"].float() / 255
        seen.append((state.global_step, int(x.sum().item() * 255)))
        loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"weights": {k: v.clone() for k, v in model.module.state_dict().items()}, "seen": seen,
            "attempt": ctx.attempt, "restored_from": state.restored_from}


def test_a_gang_killed_mid_epoch_resumes_with_the_same_augmented_pixels(spark: Any, image_dir: Path, tmp_path: Path,
                                                                         no_leaks: None) -> None:
    df = _labelled(spark, _read(spark, "binaryFile", image_dir), "path").select("content", "label")
    ds = sparkdl.write_dataset(df, str(tmp_path / "train"), num_files=2, row_group_bytes=64 * 1024)
    whole = sparkdl.run(_train_on_images, ds, {"rank": -1, "step": -1}, num_workers=2, config=CFG,
                        checkpoint_dir=str(tmp_path / "ref"))
    killed = sparkdl.run(_train_on_images, ds, {"rank": 1, "step": 5}, num_workers=2, config=CFG,
                         checkpoint_dir=str(tmp_path / "ckpt"))
    assert whole["attempt"] == 0 and killed["attempt"] == 1 and killed["restored_from"] is not None
    steps = dict(whole["seen"])
    resumed = killed["seen"]
    assert resumed[0][0] == 4  # the last checkpoint before step 5 (every 2 steps)
    assert all(steps[step] == pixels for step, pixels in resumed)  # rank 0's batches, pixel sums as before
    for key, value in whole["weights"].items():
        assert torch.equal(value, killed["weights"][key]), f"{key} differs from the uninterrupted run"
    assert np.isfinite([v.sum().item() for v in killed["weights"].values()]).all()
