"""Every subcommand and every option of ``kvstore`` says what it does in ``--help`` (issue 19):
the whole argparse tree is walked, so a command or option added without a help line fails here."""

from __future__ import annotations

import argparse

from kvstore.cli import build_parser, main


def _walk(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(command words, parser) of the top-level parser and every subcommand, nested ones included."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _walk(child, (*words, name))


def _missing_help(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> list[str]:
    missing = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue  # a hidden old spelling: not listed, so nothing to explain
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest for choice in action._choices_actions if (choice.help or "").strip()}
            missing += [
                f"{' '.join((*words, name))}: no help line in the command list"
                for name in action.choices
                if name not in helped
            ]
            continue
        if not (action.help or "").strip():
            missing.append(f"{' '.join(words) or 'kvstore'} {'/'.join(action.option_strings) or action.dest}: no help")
    return missing


def test_every_command_and_option_has_a_help_line():
    tree = list(_walk(build_parser()))
    assert len(tree) > 10  # the walk reached the subcommands (and their own subcommands)
    missing = [line for words, parser in tree for line in _missing_help(parser, words)]
    assert missing == []


def test_the_help_checker_finds_a_command_and_an_option_without_help():
    parser = argparse.ArgumentParser(prog="kvstore")
    sub = parser.add_subparsers(dest="command")
    helped = sub.add_parser("inspect", help="look at a file")
    helped.add_argument("path", help="the file")
    helped.add_argument("--json")
    sub.add_parser("bare")
    found = [line for words, child in _walk(parser) for line in _missing_help(child, words)]
    assert found == ["bare: no help line in the command list", "inspect --json: no help"]


def test_every_command_prints_its_help(capsys):
    for words, _ in _walk(build_parser()):
        assert main([*words, "--help"]) == 0, words
        assert "usage: kvstore" in capsys.readouterr().out, words
