"""The ``glm53`` command line: help texts and ``glm53 info``'s table."""

from __future__ import annotations

import argparse

import pytest

from glm53 import cli, config


def _subcommands() -> list[str]:
    (sub,) = [a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_every_subcommand_is_listed():
    assert {"serve", "info", "synth", "calibrate-router", "panel", "triton-pin"} <= set(_subcommands())


@pytest.mark.parametrize("command", [[]] + [[c] for c in _subcommands()])
def test_help_of_every_command_prints(capsys, command):
    text = _help(capsys, command)
    assert text.startswith("usage: glm53")


@pytest.mark.parametrize("command", ["serve", "info"])
def test_help_lists_every_setting_flag_with_its_meaning_intact(capsys, command):
    text = " ".join(_help(capsys, [command]).split())  # argparse wraps lines
    for f in config.setting_fields():
        if f.metadata["secret"]:
            assert f"--{f.name.replace('_', '-')}" not in text
            continue
        for flag in config.flag_names(f):
            assert flag in text
        # every meaning comes through as written (argparse %-formats help texts: a "%" in one must be escaped)
        assert " ".join(f.metadata["meaning"].split()) in text, f.name


def test_info_table_keeps_its_columns_for_long_names_and_values(tmp_path):
    model_dir = tmp_path / ("a-long-directory-name-" * 3) / "GLM-5.3-Flash-exl3"
    settings = config.load(["-m", str(model_dir)], {})
    rows = cli._settings_table(settings)
    assert len(rows) == len(config.setting_fields())
    names = [config.env_var(name) for name in settings.public()]
    values = [str(v) for v in settings.public().values()]
    value_at = {row.index(" " + value + " ", row.index(name) + len(name)) + 1 for row, name, value in zip(rows, names, values)}
    source_at = {row.rindex("(") for row in rows}
    assert len(value_at) == 1 and len(source_at) == 1
    model_row = rows[names.index("GLM53_MODEL_DIR")]
    assert model_row.split() == ["GLM53_MODEL_DIR", str(model_dir), "(flag)"]
