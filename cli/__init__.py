"""The ``kvstore`` command line: every subcommand, one argument vocabulary, one exit-code policy.

=====================  ===================================================================
module                 commands
=====================  ===================================================================
``cli/files.py``       ``inspect``, ``export``, ``migrate``, ``repair`` (one ``.coli_kv`` file)
``cli/serve.py``       ``serve`` (the HTTP service)
``cli/keys.py``        ``keys create|list|revoke`` (the service's API keys)
``cli/store_cmd.py``   ``store push|pull`` (copy sessions to and from a shared store)
``cli/sessions.py``    ``sessions ...``, ``verify`` (the session store, no server)
``cli/engine.py``      ``new-model``, ``generate``, ``chat`` (the bundled engine)
``cli/hf.py``          ``hf-chat`` (transformers models)
``cli/options.py``     the shared options: ``--tier``, ``--owner``, ``--data``, ``--json``, ids
``cli/output.py``      reports as text or JSON, JSON lines
``cli/progress.py``    the progress bar of long commands (a terminal's stderr only)
=====================  ===================================================================

Exit codes: 0 done (``inspect``: the file is clean); 1 damage found — ``inspect`` and ``verify``
print what and where; ``migrate``, ``export``, ``generate --journal`` and ``sessions append`` refuse
a damaged ``.coli_kv`` file with one line naming each damage (``--allow-damaged`` goes on with the
whole records, warns on stderr and says how many were dropped); 2 bad input or arguments (a file
that is missing, a folder, unreadable, not a ``.coli_kv`` file, a header field out of range, rows
of another model), with one line ``kvstore: error: <reason>`` on stderr that names the file, the
field and what was expected; 130 interrupted. Old option spellings print ``kvstore: warning: ...``
once and still work; warnings about damage print ``kvstore: warning: ...`` too. A command given
without its subcommand (``kvstore``, ``kvstore sessions``) prints the commands it has, as ``--help``
does, on stderr, and exits 2. A command that runs a model (``new-model``, ``generate``, ``chat``,
``hf-chat``, ``serve --model``) on an install without the engine extra exits 2 with one line that
says ``pip install 'kvstore[engine]'``.

This package is the top of the stack — the only part that may import every other one (``serve``
starts :mod:`kvstore.api`). Each command imports what it needs when it runs, so building the
parser is cheap and ``kvstore inspect`` imports neither torch nor the web stack.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import NoReturn

from kvstore import __version__, tiers
from kvstore.cli import config_cmd, crypto_cmd, engine, files, hf, keys, options, serve, sessions, store_cmd
from kvstore.config import SettingError
from kvstore.errors import FileDamaged, KVStoreError

__all__ = ["EXIT_BAD_INPUT", "EXIT_DAMAGED", "EXIT_INTERRUPTED", "EXIT_OK", "build_parser", "fail", "main"]

EXIT_OK = 0
EXIT_DAMAGED = 1  # a check found damage (what and where is printed)
EXIT_BAD_INPUT = 2  # unusable input or arguments (one line on stderr)
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


def fail(reason: str, code: int = EXIT_BAD_INPUT) -> int:
    """Print ``kvstore: error: <reason>`` (one line) on stderr; the bad-input exit code, or ``code``."""
    print(f"kvstore: error: {' '.join(reason.splitlines())}", file=sys.stderr)
    return code


#: What argparse says when a command is given without its subcommand (the metavar of every level).
_NO_SUBCOMMAND = "the following arguments are required: COMMAND"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("kvstore").strip()
        if message == _NO_SUBCOMMAND:
            # nothing to do yet: show what there is to do, as --help does (on stderr: not an answer)
            self.print_help(sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT)
        # a usage error is bad input like any other: one line, exit 2, naming the subcommand
        raise SystemExit(fail(f"{command}: {message}" if command else message))


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstore`` parser with every subcommand (imports nothing heavy)."""
    parser = _Parser(prog="kvstore", description="Resumable LLM conversations over .coli_kv latent caches.")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    files.add_commands(sub)
    serve.add_commands(sub)
    keys.add_commands(sub)
    crypto_cmd.add_commands(sub)
    sessions.add_commands(sub)
    engine.add_commands(sub)
    sessions.add_verify(sub)
    hf.add_commands(sub)
    store_cmd.add_commands(sub)
    config_cmd.add_commands(sub)
    return parser


class _Warnings:
    """Shows old-spelling warnings as ``kvstore: warning: ...``, each text once per command;
    other warnings go to the previous handler unchanged."""

    def __init__(self, previous):
        self.previous = previous
        self.shown: set[str] = set()

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, tiers.TierSpellingDeprecated):
            self.previous(message, category, filename, lineno, file, line)
            return
        if str(message) not in self.shown:
            self.shown.add(str(message))
            print(f"kvstore: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run one ``kvstore`` command; returns its exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    with warnings.catch_warnings():
        warnings.simplefilter("always", tiers.TierSpellingDeprecated)
        warnings.showwarning = _Warnings(warnings.showwarning)
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help, --version, usage errors (already printed)
            return int(exc.code or EXIT_OK)
        try:
            options.resolve_tier(args)
            return int(args.func(args) or EXIT_OK)
        except FileDamaged as exc:
            return fail(exc.reason, EXIT_DAMAGED)
        except (KVStoreError, SettingError) as exc:  # SettingError: a variable of kvstore.config
            return fail(exc.reason)
        except ModuleNotFoundError as exc:  # a module of the engine extra, met past the command's own check
            package = (exc.name or "").partition(".")[0]
            if package not in options.ENGINE_PACKAGES:
                raise
            return fail(options.missing_engine_reason(args.command, [package]))
        except OSError as exc:  # a path the command did not check itself: still one line naming it
            where = ", ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
            return fail(f"{where or 'a file'}: {(exc.strerror or str(exc)).lower()}")
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
