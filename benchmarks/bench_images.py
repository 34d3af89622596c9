"""Images from Spark to torch: sparkdl's loader against torch's DataLoader and Petastorm's converter.

The same ``--images`` JPEGs (real photos cut from scikit-learn's sample images, 300-427 x 350-640
pixels, ~53 KiB; ``tests/resources/photos.py``) are decoded, randomly cropped to 224 x 224 and
flipped, in batches of ``--batch``, by each way, each in a fresh process of its own while this one
samples that process tree's memory (RSS of the process and its workers, summed, every 20 ms):

- **DataLoader**: torch's ``DataLoader`` over the image files, ``num_workers`` = the cores,
  ``persistent_workers=True``, running the user's function (below). The baseline.
- **sparkdl, user's function, threads / processes**: ``ds.loader(..., decode={"content": fn})``
  over the same images written by Spark's ``binaryFile`` source through ``write_dataset``, with
  the same function, one decode worker per core.
- **sparkdl's converter, TransformSpec**: ``sparkdl.compat.petastorm``'s ``make_torch_dataloader``
  over the same files with the same ``TransformSpec`` as Petastorm's way below (the user's
  function over each pandas batch) on decode processes: a chunk of rows a call, since that
  function draws from a generator of its own; ``-global``: the same function drawing from numpy's
  global generator, which sparkdl then calls one row at a time, each seeded from the row.
- **sparkdl, ImageDecoder**: sparkdl's own decoder (the same crop and flip, decoded at a smaller
  scale in the DCT domain when the crop allows, uint8 throughout).
- **sparkdl, DALI** (when NVIDIA DALI is installed: ``SPARKDL_WITH_DALI=1 bash tools/bootstrap.sh``):
  ``ImageDecoder(224, engine="dali")``, DALI's CPU operators on each batch, the same regions and
  flips.
- **Petastorm converter** (``--classic-python``, the classic stack's interpreter):
  ``make_spark_converter`` of the same DataFrame + ``make_torch_dataloader`` with a
  ``TransformSpec`` running the user's function.
- **Ray Data** (``--ray-python``, an environment of its own with ``ray[data]`` and torch, not a test
  stack): ``read_binary_files`` over the image files + ``map_batches`` running the user's function
  + ``iter_torch_batches`` with a local shuffle buffer of 4 batches, ``num_cpus`` = the cores.

The user's function is what a user writes for a DataLoader: Pillow decode, a random resized crop
(area 8-100%, aspect 3/4-4/3) resized to 224 bilinear, a random flip, a uint8 ``[3, 224, 224]``
array. Each way runs one epoch to warm up, then ``--epochs`` timed ones; images/s is over the timed
epochs. Targets (issue 34): sparkdl with the user's function >= 1.0x DataLoader; with ImageDecoder
>= 1.5x; >= 3x Petastorm; >= 1.0x Ray Data; peak RSS <= 1.25x DataLoader's.

    .venv/bin/python benchmarks/bench_images.py                      # 2,000 images, batch 64
    .venv/bin/python benchmarks/bench_images.py --classic-python .venv-classic/bin/python \
        --ray-python .venv-ray/bin/python     # python3 -m venv .venv-ray; pip install 'ray[data]' pydantic torch pillow psutil
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WAYS = ("dataloader", "sparkdl-user-threads", "sparkdl-user-processes", "sparkdl-transformspec",
        "sparkdl-transformspec-global", "sparkdl-imagedecoder",
        "sparkdl-dali")


def user_decode(data: bytes, rng: Any) -> Any:
    """The user's decode-and-augment function (the same on every side)."""
    import io

    import numpy as np
    from PIL import Image

    im = Image.open(io.BytesIO(data)).convert("RGB")
    width, height = im.size
    w, h = width, height
    for _ in range(10):
        area = width * height * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            break
    else:
        w, h = min(width, height), min(width, height)
    x, y = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
    im = im.resize((224, 224), Image.Resampling.BILINEAR, box=(x, y, x + w, y + h))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.ascontiguousarray(np.asarray(im).transpose(2, 0, 1))


def cores() -> int:
    return len(os.sched_getaffinity(0))


# -- the ways, each run in a child process: prints {"images": n, "seconds": s} -----------------


def _time(batches_of_epoch: Any, epochs: int) -> dict[str, float]:
    for _ in batches_of_epoch(0):
        pass
    started, n = time.perf_counter(), 0
    for e in range(1, epochs + 1):
        for batch in batches_of_epoch(e):
            n += len(batch)
    return {"images": n, "seconds": time.perf_counter() - started}


def way_dataloader(files: list[str], batch: int, epochs: int) -> dict[str, float]:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset, get_worker_info

    rngs: dict[int, Any] = {}

    class Files(Dataset):
        def __len__(self) -> int:
            return len(files)

        def __getitem__(self, i: int) -> Any:
            info = get_worker_info()
            key = info.id if info else -1
            if key not in rngs:  # one generator per worker, seeded as torch seeds the worker
                rngs[key] = np.random.default_rng(torch.initial_seed() % 2**32)
            rng = rngs[key]
            with open(files[i], "rb") as f:
                return torch.from_numpy(user_decode(f.read(), rng))

    loader = DataLoader(Files(), batch_size=batch, shuffle=True, num_workers=cores(), persistent_workers=True)
    return _time(lambda e: loader, epochs)


def way_sparkdl(dataset: str, batch: int, epochs: int, decoder: str, kind: str) -> dict[str, float]:
    import sparkdl

    fns = {"imagedecoder": sparkdl.ImageDecoder(224), "dali": sparkdl.ImageDecoder(224, engine="dali")}
    fn = fns.get(decoder, user_decode)
    ds = sparkdl.Dataset(dataset)
    loader = ds.loader(batch, columns=["content"], decode={"content": fn}, decode_in=kind, seed=0)

    def epoch(e: int) -> Any:
        loader.set_epoch(e)
        return (b["content"] for b in loader)

    try:
        return _time(epoch, epochs)
    finally:
        loader.close()


class _GlobalDraws:
    """numpy's global generator with the methods ``user_decode`` calls, as a function that draws
    from ``np.random`` (or torchvision's transforms, from torch's) has it."""

    def uniform(self, low: float, high: float) -> float:
        import numpy as np

        return float(np.random.uniform(low, high))

    def integers(self, low: int, high: int) -> int:
        import numpy as np

        return int(np.random.randint(low, high))

    def random(self) -> float:
        import numpy as np

        return float(np.random.random())


def _spec(transform_spec: Any, global_draws: bool = False) -> Any:
    """The tutorial's TransformSpec: the user's function over each pandas batch's photos, drawing
    from a generator of its own, or (``global_draws``) from numpy's global one."""
    import numpy as np

    rng = _GlobalDraws() if global_draws else np.random.default_rng(0)

    def transform(pdf: Any) -> Any:
        pdf["content"] = [user_decode(bytes(v), rng) for v in pdf["content"]]
        return pdf

    return transform_spec(transform, edit_fields=[("content", np.uint8, (3, 224, 224), False)])


def way_sparkdl_spec(dataset: str, batch: int, epochs: int, global_draws: bool = False) -> dict[str, float]:
    import sparkdl
    from sparkdl.compat.petastorm import SparkDatasetConverter, TransformSpec

    ds = sparkdl.Dataset(dataset)
    converter = SparkDatasetConverter(ds.url, [], ds.num_rows)
    n = len(converter)
    with converter.make_torch_dataloader(batch_size=batch, num_epochs=None, transform_spec=_spec(TransformSpec, global_draws),
                                         schema_fields=["content"], cur_shard=0, shard_count=1) as loader:
        it = iter(loader)

        def epoch(e: int) -> Any:
            for _ in range(math.ceil(n / batch)):
                yield next(it)["content"]

        return _time(epoch, epochs)


def way_petastorm(images: str, batch: int, epochs: int) -> dict[str, float]:
    from petastorm import TransformSpec
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "2g").getOrCreate())
    cache = tempfile.mkdtemp(prefix="bench-images-petastorm-")
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "file://" + cache)
    df = spark.read.format("binaryFile").load(images).select("content")
    converter = make_spark_converter(df)
    spec = _spec(TransformSpec)
    n = len(converter)
    try:
        with converter.make_torch_dataloader(batch_size=batch, num_epochs=None, transform_spec=spec,
                                             workers_count=cores()) as loader:
            it = iter(loader)

            def epoch(e: int) -> Any:
                for _ in range(math.ceil(n / batch)):
                    yield next(it)["content"]

            return _time(epoch, epochs)
    finally:  # the converter's cache and the directory it was put in (Petastorm leaves the latter)
        converter.delete()
        spark.stop()
        shutil.rmtree(cache, ignore_errors=True)


def way_ray(images: str, batch: int, epochs: int) -> dict[str, float]:
    import numpy as np
    import ray

    ray.init(num_cpus=cores(), include_dashboard=False, log_to_driver=False)
    try:
        rng = np.random.default_rng(0)

        def decode(rows: dict[str, Any]) -> dict[str, Any]:
            return {"content": np.stack([user_decode(bytes(b), rng) for b in rows["bytes"]])}

        data = ray.data.read_binary_files(images).map_batches(decode, batch_size=batch, batch_format="numpy")

        def epoch(e: int) -> Any:
            return (b["content"] for b in data.iter_torch_batches(batch_size=batch, local_shuffle_buffer_size=4 * batch))

        return _time(epoch, epochs)
    finally:
        ray.shutdown()


def child(argv: list[str]) -> None:
    way, where, batch, epochs = argv[0], argv[1], int(argv[2]), int(argv[3])
    if way == "dataloader":
        files = sorted(str(p) for p in Path(where).glob("*.jpg"))
        out = way_dataloader(files, batch, epochs)
    elif way == "petastorm":
        out = way_petastorm(where, batch, epochs)
    elif way == "ray":
        out = way_ray(where, batch, epochs)
    elif way in ("sparkdl-transformspec", "sparkdl-transformspec-global"):
        out = way_sparkdl_spec(where, batch, epochs, global_draws=way.endswith("global"))
    else:
        decoder = way.rsplit("-", 1)[1] if way.endswith(("imagedecoder", "dali")) else "user"
        out = way_sparkdl(where, batch, epochs, decoder, "processes" if way.endswith("processes") else "threads")
    print("RESULT " + json.dumps(out), flush=True)


# -- the parent: data, children, memory ------------------------------------------------------------


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += q.memory_info().rss
    return total


def run_child(python: str, way: str, where: str, batch: int, epochs: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), str(ROOT / "tests" / "resources")]))
    proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--child", way, where, str(batch), str(epochs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], _tree_rss(proc.pid))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate(timeout=1800)
    done.set()
    t.join()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{way} failed (exit {proc.returncode}):\n{err[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["peak_rss"] = peak[0]
    return result


def prepare(tmp: Path, n: int) -> tuple[str, str]:
    """The photos as files, and as a sparkdl dataset written from Spark's binaryFile source."""
    from photos import photos

    images = tmp / "images"
    images.mkdir()
    for i, data in enumerate(photos(n)):
        (images / f"img_{i:05d}.jpg").write_bytes(data)
    from pyspark.sql import SparkSession

    import sparkdl

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    try:
        df = spark.read.format("binaryFile").load(str(images)).select("path", "content")
        sparkdl.write_dataset(df, str(tmp / "dataset"))
    finally:
        spark.stop()
    return str(images), str(tmp / "dataset")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs, after one to warm up")
    parser.add_argument("--classic-python", default=None, help="the classic stack's python, for Petastorm's converter")
    parser.add_argument("--ray-python", default=None,
                        help="the python of an environment with ray[data] and torch, for Ray Data (not a test stack)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"a subset of {','.join(WAYS)}")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "tests" / "resources")]
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        images, dataset = prepare(Path(tmp), args.images)
        ways = args.ways.split(",")
        if "sparkdl-dali" in ways and subprocess.run([sys.executable, "-c", "import nvidia.dali"],
                                                     capture_output=True).returncode != 0:
            print("sparkdl-dali: left out, NVIDIA DALI is not installed (SPARKDL_WITH_DALI=1 bash tools/bootstrap.sh)")
            ways.remove("sparkdl-dali")
        runs: list[tuple[str, str, str]] = [(w, sys.executable, images if w == "dataloader" else dataset)
                                            for w in ways]
        if args.classic_python:
            runs.append(("petastorm", args.classic_python, images))
        if args.ray_python:
            runs.append(("ray", args.ray_python, images))
        print(f"{args.images} JPEGs, batch {args.batch}, {cores()} cores, {args.epochs} timed epochs after 1 warm-up")
        results: dict[str, dict[str, float]] = {}
        for way, python, where in runs:
            results[way] = r = run_child(python, way, where, args.batch, args.epochs)
            print(f"  {way:<24} {r['images'] / r['seconds']:8.0f} images/s   peak RSS {r['peak_rss'] / 2**20:7.0f} MiB",
                  flush=True)
    base = results.get("dataloader")
    if base:
        rate = base["images"] / base["seconds"]
        print("against the DataLoader (images/s, peak RSS):")
        for way, r in results.items():
            print(f"  {way:<24} {r['images'] / r['seconds'] / rate:5.2f}x   {r['peak_rss'] / base['peak_rss']:5.2f}x")
    for peer, title in (("petastorm", "Petastorm's converter"), ("ray", "Ray Data")):
        if peer in results:
            p = results[peer]
            print(f"against {title} (images/s):")
            for way, r in results.items():
                if way.startswith("sparkdl"):
                    print(f"  {way:<24} {(r['images'] / r['seconds']) / (p['images'] / p['seconds']):5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
