"""What is public, pinned: the names each public module exports (its ``__all__``), all of them
in the API reference (docs/reference/api.md) and nothing else of sparkdl there. Adding, removing
or renaming a public name is then a change to this list, to the docs and to the CHANGELOG, never
an accident; every other module of the package is internal."""

from __future__ import annotations

import importlib
import re

import pytest
from conftest import REPO

PUBLIC = {
    "sparkdl": {
        "BackendUnavailableError", "CheckpointStore", "ConfigError", "Dataset", "DatasetError", "HorovodRunner",
        "ImageDecoder", "InsufficientSlotsError", "NotInRunError", "RunConfig", "RunContext", "RunFailedError",
        "RunResult", "RunTimeoutError", "SparkDLError", "TorchDistributor", "TorchEstimator", "TorchModel",
        "TrainState", "TrialPruned", "context", "keras_checkpoint", "keras_resume", "launch", "run", "tune", "write_dataset",
    },
    "sparkdl.data": {"Dataset", "write_dataset"},
    "sparkdl.ml": {"TorchEstimator", "TorchModel"},
    "sparkdl.compat": {"GpuConfigError", "HorovodRunner", "MirroredStrategyRunner", "TorchDistributor"},
    "sparkdl.compat.petastorm": {"SparkDatasetConverter", "TransformSpec", "make_spark_converter"},
}
# Documented because the public API hands them out (ds.loader(), converter.make_torch_dataloader()),
# not to be imported: their module paths may change.
HANDED_OUT = {"sparkdl._internal.data.loader.Loader", "sparkdl.compat.petastorm.TorchDataLoader",
              "sparkdl._internal.wire.trial.TrialSpec"}
API_PAGE = REPO / "docs" / "reference" / "api.md"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_each_public_module_exports_exactly_its_pinned_names(module: str) -> None:
    mod = importlib.import_module(module)
    assert set(mod.__all__) == PUBLIC[module]
    for name in mod.__all__:
        assert getattr(mod, name) is not None


def test_the_api_reference_documents_every_public_name_and_nothing_internal() -> None:
    documented = set(re.findall(r"^\.\. auto(?:function|class|exception):: (\S+)", API_PAGE.read_text(), re.M))
    public = {f"{module}.{name}" for module, names in PUBLIC.items() for name in names}
    # A name exported by several modules is documented once, under any of them.
    by_name = {name: {f"{m}.{name}" for m, names in PUBLIC.items() if name in names} for names in PUBLIC.values()
               for name in names}
    undocumented = sorted(name for name, paths in by_name.items() if not paths & documented)
    assert not undocumented, f"public names missing from {API_PAGE.name}: {undocumented}"
    internal = sorted(documented - public - HANDED_OUT)
    assert not internal, f"{API_PAGE.name} documents names outside the public API: {internal}"
