"""sparkdl._internal.spark.session without a JVM: the properties-file reader and ``--conf KEY=VALUE``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sparkdl._internal.common.errors import ConfigError
from sparkdl._internal.spark.session import conf_pair, read_properties


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spark-defaults.conf"
    path.write_text(text, encoding="utf-8")
    return path


def test_every_separator_form_and_comments_and_blank_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "# a comment\n"
        "! also a comment\n"
        "\n"
        "   \n"
        "spark.a   1\n"
        "spark.b=two words\n"
        "spark.c : -Dx=1 -Dy=2\n"
        "spark.d\tvalue\n"
        "spark.e = spaced equals\n"
        "spark.f:colon\n"
        "  spark.g  indented  \n"
        "spark.h=\n",
    )
    assert read_properties(path) == {
        "spark.a": "1",
        "spark.b": "two words",
        "spark.c": "-Dx=1 -Dy=2",
        "spark.d": "value",
        "spark.e": "spaced equals",
        "spark.f": "colon",
        "spark.g": "indented",
        "spark.h": "",
    }


def test_a_later_line_wins_and_a_string_path_works(tmp_path: Path) -> None:
    path = _write(tmp_path, "spark.a 1\nspark.a 2\n")
    assert read_properties(str(path)) == {"spark.a": "2"}


def test_an_empty_file_has_no_properties(tmp_path: Path) -> None:
    assert read_properties(_write(tmp_path, "")) == {}


@pytest.mark.parametrize(("text", "line"), [("spark.a 1\nspark.lonely\n", 2), ("# c\n\nspark.b=1\n  key-only  \n", 4)])
def test_a_line_without_a_value_names_the_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        read_properties(path)
    bad = text.splitlines()[line - 1]
    assert str(exc.value) == f"{path}:{line}: expected 'key value', got {bad!r}"


def test_a_missing_file_is_not_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_properties(tmp_path / "nope.conf")


@pytest.mark.parametrize(
    ("text", "pair"),
    [
        ("spark.x=1", ("spark.x", "1")),
        ("spark.y=a=b", ("spark.y", "a=b")),
        (" spark.z =  v ", ("spark.z", "  v ")),
        ("spark.empty=", ("spark.empty", "")),
    ],
)
def test_conf_pair_splits_at_the_first_equals_sign(text: str, pair: tuple[str, str]) -> None:
    assert conf_pair(text) == pair


@pytest.mark.parametrize("text", ["no-equals-sign", "=value", "  =value", ""])
def test_conf_pair_refuses_what_is_not_key_equals_value(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        conf_pair(text)
    assert str(exc.value) == f"--conf takes KEY=VALUE, e.g. spark.executor.memory=2g; got {text!r}"


def test_conf_pair_is_a_usage_error_through_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--conf", type=conf_pair, action="append", default=[])
    assert parser.parse_args(["--conf", "a=1", "--conf", "b=2"]).conf == [("a", "1"), ("b", "2")]
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--conf", "bad"])
    assert exc.value.code == 2
    assert "--conf takes KEY=VALUE" in capsys.readouterr().err
