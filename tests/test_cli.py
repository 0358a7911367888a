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
    # a help text with a percent sign comes through as written
    assert "adds 8-11 % to one stream" in text

