"""The loader's settings as one object (sparkdl/_internal/data/loader_options.py): ``Dataset.loader``'s
keywords are its fields, with the same defaults, so a setting added to one is in the other; every
caller's settings are checked when the object is made, with one shape of error."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from sparkdl import ConfigError, Dataset, write_dataset
from sparkdl._internal.data.loader_options import LoaderOptions
from sparkdl._internal.data.writing.write import WriteOptions


def test_dataset_loader_takes_exactly_the_options_with_their_defaults() -> None:
    params = inspect.signature(Dataset.loader).parameters
    keywords = {name: None if p.default is p.empty else p.default for name, p in params.items() if name != "self"}
    fields = {f.name: None if f.default is dataclasses.MISSING else f.default
              for f in dataclasses.fields(LoaderOptions) if f.name != "shard_by"}
    assert keywords == fields


def test_options_are_checked_when_made_and_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"^prefetch must be an integer >= 0; got -1$"):
        LoaderOptions(8, prefetch=-1)
    with pytest.raises(ConfigError, match=r"^transform must be a callable, batch dict -> batch dict; got 3$"):
        LoaderOptions(8, transform=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^columns must be a list of column names.*; got 'label'$"):
        LoaderOptions(8, columns="label")
    with pytest.raises(ConfigError, match=r"both rank and world_size, or neither"):
        LoaderOptions(8, world_size=2)
    # numpy integers (a search's sampled batch size) are integers.
    assert LoaderOptions(np.int64(16), seed=np.int32(3)).batch_size == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoaderOptions(8).batch_size = 4  # type: ignore[misc]


def test_an_unknown_keyword_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown loader keyword 'shufle'.*\(epoch, shuffle, seed, "):
        LoaderOptions.of(8, {"shufle": False})
    assert LoaderOptions.of(8, {"seed": 3}) == LoaderOptions(8, seed=3)


def test_write_dataset_takes_exactly_the_write_options_with_their_defaults() -> None:
    params = inspect.signature(write_dataset).parameters
    keywords = {name: p.default for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == {f.name: f.default for f in dataclasses.fields(WriteOptions)}
    with pytest.raises(ConfigError, match=r"^num_files must be an integer >= 1 or None .*; got 0$"):
        WriteOptions(num_files=0)
    with pytest.raises(ConfigError, match=r"^vector_dtype must be one of 'float32' .*; got 'int8'$"):
        WriteOptions(vector_dtype="int8")
