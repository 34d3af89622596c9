"""How a loader reads, as one typed object: :class:`LoaderOptions`.

``Dataset.loader``'s keywords, ``Dataset.tf_dataset``'s, the Petastorm converter's translation of
``make_torch_dataloader``/``make_tf_dataset`` and :class:`~sparkdl._internal.data.loader.Loader`
itself all go through it: the settings are named, defaulted and checked in one place (each error
names the setting, what it got and what is allowed, :mod:`sparkdl._internal.common.validate`).
What needs the dataset or the run (the columns against the manifest, the rank from
``sparkdl.context()``, the device) is checked when the loader is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.common.validate import int_at_least, invalid, one_of

READERS = {"arrow": "sparkdl's reader", "petastorm": "Petastorm's make_batch_reader, on the classic stack"}
WORKER_KINDS = {"threads": "for functions that release the GIL, like Pillow's decoding", "processes": "forked when the loader is made"}
ON_BAD = {"raise": "stop, naming the row and column", "skip": "leave the row out, count it in loader.skipped"}
SHARDS = {"rows": "equal shares of the stream", "row_groups": "Petastorm's shards, where they hold equal rows"}


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """The loader's settings; their meaning is documented on :meth:`Dataset.loader`, whose keywords
    are these fields but ``shard_by`` (the Petastorm converter's: ``"row_groups"`` takes Petastorm's
    shards, row group ``g`` to rank ``g % world_size``, where they hold equal rows)."""

    batch_size: int
    epoch: int = 0
    shuffle: bool = True
    seed: int = 0
    columns: Sequence[str] | None = None
    drop_last: bool = False
    rank: int | None = None
    world_size: int | None = None
    reader: str = "arrow"
    transform: Callable[[Any], Any] | None = None
    prefetch: int = 4
    shuffle_window: int | None = None
    device: Any = None
    pin_memory: bool | None = None
    petastorm_workers: int = 2
    to_device: bool = False
    decode: Mapping[str, Callable[[Any, Any], Any]] | None = None  # column -> fn(value, rng)
    decode_workers: int | None = None
    decode_in: str = "threads"
    on_bad_sample: str = "raise"
    read_threads: int | None = None
    workers: int = 0
    shard_by: str = "rows"

    def __post_init__(self) -> None:
        int_at_least("batch_size", self.batch_size, 1)
        int_at_least("epoch", self.epoch, 0)
        int_at_least("seed", self.seed, 0)
        int_at_least("prefetch", self.prefetch, 0)
        int_at_least("petastorm_workers", self.petastorm_workers, 1)
        int_at_least("shuffle_window", self.shuffle_window, 1, allow_none=True)
        int_at_least("read_threads", self.read_threads, 1, allow_none=True, note=" (None: a quarter of the cores, 1 to 4)")
        int_at_least("workers", self.workers, 0, note=" (0: the loader's threads, in the training process)")
        if self.workers and self.reader != "arrow":
            raise invalid("workers", self.workers, f"0 with reader={self.reader!r} (worker processes play "
                          "sparkdl's own reader, reader='arrow')")
        if (self.rank is None) != (self.world_size is None):
            raise ConfigError(
                f"pass both rank and world_size, or neither (got rank={self.rank!r}, world_size={self.world_size!r}); "
                "without them they come from sparkdl.context() or torch.distributed"
            )
        if self.world_size is not None:
            world = int_at_least("world_size", self.world_size, 1)
            if int_at_least("rank", self.rank, 0) >= world:  # type: ignore[operator]
                raise invalid("rank", self.rank, f"below world_size={world}")
        one_of("reader", self.reader, READERS)
        one_of("shard_by", self.shard_by, SHARDS)
        if self.transform is not None and not callable(self.transform):
            raise invalid("transform", self.transform, "a callable, batch dict -> batch dict")
        if isinstance(self.columns, str):
            raise invalid("columns", self.columns, "a list of column names, e.g. columns=['features', 'label']")
        if self.decode is not None:
            if not isinstance(self.decode, Mapping):
                raise invalid("decode", self.decode, "a mapping of column names to per-sample functions, "
                              "e.g. decode={'content': sparkdl.ImageDecoder(224)}")
            for name, fn in self.decode.items():
                if not callable(fn):
                    raise invalid(f"decode[{name!r}]", fn, "callable as fn(value, rng)")
        int_at_least("decode_workers", self.decode_workers, 1, allow_none=True, note=" (None: one per core)")
        one_of("decode_in", self.decode_in, WORKER_KINDS)
        one_of("on_bad_sample", self.on_bad_sample, ON_BAD)

    @classmethod
    def of(cls, batch_size: int, keywords: Mapping[str, Any]) -> LoaderOptions:
        """The options of a call with these keywords; an unknown keyword is a ConfigError that lists the known ones."""
        known = [f.name for f in dataclasses.fields(cls) if f.name not in ("batch_size", "shard_by")]
        unknown = sorted(set(keywords) - set(known))
        if unknown:
            raise ConfigError(f"unknown loader keyword {unknown[0]!r}: the keywords are those of Dataset.loader "
                              f"({', '.join(known)})")
        return cls(batch_size, **keywords)

    @classmethod
    def from_call(cls, arguments: Mapping[str, Any]) -> LoaderOptions:
        """The options of a method whose parameters are these fields (``Dataset.loader``): pass its
        ``locals()`` before it binds anything else; ``self`` is left out."""
        return cls(**{name: value for name, value in arguments.items() if name != "self"})

