"""gpu-check's image checks: JPEGs decoded on the GPU (nvJPEG) by the loader, against the CPU
decoder, and a ResNet-18 fed by it. Without Spark: the photos are written with pyarrow.

On ``--cpu`` only the CPU decoder's check runs (the same pixels with 1 and 2 decode threads);
the others need CUDA and torchvision.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

Result = tuple[str, str, str]
WAIT_TARGET = 0.05


def write_photos(path: Path, n: int) -> None:
    """``n`` real photos (tests/resources/photos.py) as one Parquet file of 64-row row groups."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from photos import photos

    path.mkdir(parents=True, exist_ok=True)
    data = photos(n)
    table = pa.table({"content": pa.array(data, pa.binary()), "label": pa.array(np.arange(n) % 10, pa.int64())})
    pq.write_table(table, path / "part-0.parquet", row_group_size=64)


def _rate(loader: Any, epochs: int = 1) -> tuple[float, list[Any]]:
    import torch

    first: list[Any] = []
    started, n = time.perf_counter(), 0
    for _ in range(epochs):
        for batch in loader:
            x = batch["content"]
            if x.is_cuda:
                torch.cuda.current_stream().synchronize()
            n += len(x)
            if len(first) < 2:
                first.append(x.cpu())
    return n / (time.perf_counter() - started), first


def image_checks(cuda: bool, tmp: Path) -> list[Result]:
    """The image checks' results (``PASS``/``FAIL``/``SKIP``, name, detail)."""
    import torch

    import sparkdl

    results: list[Result] = []
    write_photos(tmp / "photos", 2048 if cuda else 256)
    ds = sparkdl.Dataset(str(tmp / "photos"))
    cpu_decoder = sparkdl.ImageDecoder(224)

    def cpu_same() -> str:
        one = ds.loader(64, decode={"content": cpu_decoder}, decode_workers=1, seed=5, epoch=1)
        two = ds.loader(64, decode={"content": cpu_decoder}, decode_workers=4, seed=5, epoch=1)
        a, b = list(one), list(two)
        if not all(torch.equal(x["content"], y["content"]) for x, y in zip(a, b, strict=True)):
            raise AssertionError("1 and 4 decode threads gave other pixels")
        return f"{len(a)} batches of uint8 {tuple(a[0]['content'].shape)}: the same pixels with 1 and 4 threads"

    results.append(_attempt("image decode on the CPU (Pillow, threads)", cpu_same))
    results.append(_dali_check(cuda, ds, cpu_decoder))
    names = ["nvJPEG decode against the CPU decoder", "nvJPEG images per second against the CPU decoder",
             "ResNet-18 at 224 px fed by nvJPEG, data wait", "ResNet-50 at 224 px fed by nvJPEG, data wait"]
    if not cuda:
        return results + [("SKIP", n, "needs CUDA") for n in names]
    try:
        import torchvision
    except ImportError:
        return results + [("SKIP", n, "needs torchvision") for n in names]
    gpu_decoder = sparkdl.ImageDecoder(224, device="cuda")

    def same_pixels() -> str:
        worst = _worst_difference(ds, cpu_decoder, gpu_decoder)
        if worst > 8:
            raise AssertionError(f"mean absolute difference {worst:.2f} levels (> 8): other crops or flips?")
        return (f"4 batches of 64 on {torch.cuda.get_device_name(0)}: the same crops and flips as the CPU, "
                f"mean |GPU - CPU| {worst:.2f} of 255 levels (the CPU decodes at 1/2 to 1/8 scale in the DCT domain)")

    def speed() -> str:
        cpu = ds.loader(64, decode={"content": cpu_decoder}, seed=1)
        gpu = ds.loader(64, decode={"content": gpu_decoder}, seed=1)
        _rate(gpu)  # warm up nvJPEG and the allocator
        g, _ = _rate(gpu, 2)
        c, _ = _rate(cpu, 1)
        cpu.close()
        gpu.close()
        import os

        return (f"{g:,.0f} images/s on the GPU, {c:,.0f} on {len(os.sched_getaffinity(0))} CPU threads (Pillow): "
                f"{g / c:.2f}x; torchvision {torchvision.__version__}")

    def fed_resnet(depth: int) -> Result:
        build = torchvision.models.resnet18 if depth == 18 else torchvision.models.resnet50
        model = build(num_classes=10).cuda().to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
        std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
        loader = ds.loader(128, decode={"content": gpu_decoder}, seed=2, drop_last=True, to_device=True, prefetch=6)
        waited = steps = 0.0
        started = 0.0
        for epoch in range(3):
            it = iter(loader)
            while True:
                t = time.perf_counter()
                batch = next(it, None)
                if batch is None:
                    break
                if epoch > 0:
                    waited += time.perf_counter() - t
                x = ((batch["content"].float() - mean) / std).contiguous(memory_format=torch.channels_last)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(model(x), batch["label"].cuda(non_blocking=True))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                torch.cuda.current_stream().synchronize()
                if epoch > 0:
                    steps += 1
            if epoch == 0:
                started = time.perf_counter()
        total = time.perf_counter() - started
        loader.close()
        share = waited / total
        detail = (f"{steps:.0f} steps of 128 (bf16 autocast, channels_last): {steps * 128 / total:,.0f} images/s, "
                  f"waiting for data {share:.1%} of the time (target < {WAIT_TARGET:.0%})")
        name = names[2] if depth == 18 else names[3]
        return ("PASS" if share < WAIT_TARGET else "FAIL", name, detail)

    results.append(_attempt(names[0], same_pixels))
    results.append(_attempt(names[1], speed))
    results.append(_attempt(names[2], lambda: fed_resnet(18)))
    results.append(_attempt(names[3], lambda: fed_resnet(50)))
    return results


def _worst_difference(ds: Any, cpu_decoder: Any, gpu_decoder: Any) -> float:
    """The largest mean |GPU - CPU| over 4 batches of 64 decoded with the same seed, after checking
    that the GPU's batches are uint8 on the GPU, shaped like the CPU's."""
    import torch

    cpu = ds.loader(64, decode={"content": cpu_decoder}, seed=9, shuffle=False)
    gpu = ds.loader(64, decode={"content": gpu_decoder}, seed=9, shuffle=False)
    diffs = []
    for k, (x, y) in enumerate(zip(cpu, gpu, strict=True)):
        if k == 4:
            break
        if not y["content"].is_cuda or y["content"].dtype != torch.uint8 or y["content"].shape != x["content"].shape:
            raise AssertionError(f"GPU batch {y['content'].dtype} {tuple(y['content'].shape)} on {y['content'].device}")
        diffs.append((y["content"].cpu().float() - x["content"].float()).abs().mean().item())
    cpu.close()
    gpu.close()
    return max(diffs)


def _dali_check(cuda: bool, ds: Any, cpu_decoder: Any) -> Result:
    """DALI's GPU engine (``ImageDecoder(engine="dali", device="cuda")``): the CPU decoder's crops
    and flips, on the GPU, and its rate."""
    import importlib.util

    import sparkdl

    name = "DALI decode on the GPU against the CPU decoder"
    if not cuda:
        return ("SKIP", name, "needs CUDA")
    if importlib.util.find_spec("nvidia.dali") is None:
        return ("SKIP", name, "needs NVIDIA DALI (pip install 'sparkdl[dali]')")

    def check() -> str:
        dali = sparkdl.ImageDecoder(224, engine="dali", device="cuda")
        worst = _worst_difference(ds, cpu_decoder, dali)
        if worst > 12:
            raise AssertionError(f"mean absolute difference {worst:.2f} levels (> 12): other crops or flips?")
        gpu = ds.loader(64, decode={"content": dali}, seed=1)
        _rate(gpu)
        rate, _ = _rate(gpu, 2)
        gpu.close()
        return f"the CPU decoder's crops (mean |DALI - CPU| {worst:.2f} levels); {rate:,.0f} images/s"

    return _attempt(name, check)


def _attempt(name: str, check: Any) -> Result:
    try:
        out = check()
    except Exception as exc:
        return ("FAIL", name, f"{type(exc).__name__}: {exc}")
    return out if isinstance(out, tuple) else ("PASS", name, out)
