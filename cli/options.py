"""The argument vocabulary every ``kvstore`` subcommand shares: ``--tier``, ``--owner``, ``--data``,
``--json`` and token ids, each spelled and defaulted the same way wherever a command takes it.

``--tier NAME`` takes the canonical names of :mod:`kvstore.tiers`. Old spellings (``v2``,
``tq-int4``, ``tq-polar`` + ``--bits``, ``int8``, ``--to v3 --codec int4`` ...) still work for one
release: :func:`resolve_tier` folds them into a tier through ``tiers.parse``, whose deprecation
warning the CLI prints once as ``kvstore: warning: ...``. The tier is resolved after parsing (the
old ``--codec``/``--bits`` options qualify it), so ``args.tier`` holds a ``Tier`` (or None) by the
time a command runs.

The engine is an extra of the install (``pip install 'kvstore[engine]'``): :func:`require_engine`
refuses a command that runs a model, in one line that says how to add it, before anything is done.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvstore import DEFAULT_OWNER, config, tiers
from kvstore.errors import InvalidRequest

DEFAULT_DATA = config.DATA_DIR.value
#: What the ``engine`` extra installs: the packages a command that runs a model imports.
ENGINE_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers")
ENGINE_INSTALL = "pip install 'kvstore[engine]'"


# ---------------------------------------------------------------------------- the engine extra
def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # an import hook refused it, or a module set to None
        return False


def engine_install_hint() -> str:
    """How to add the engine: ``pip install 'kvstore[engine]'``, and the same through the Python that
    runs this kvstore (the ``pip`` on PATH may be another environment's). With kvstore installed, pip
    keeps it (a checkout's editable install included) and adds the extra's packages."""
    return f"{ENGINE_INSTALL} (into this kvstore's environment: {sys.executable} -m {ENGINE_INSTALL})"


def missing_engine_reason(command: str, missing: list[str]) -> str:
    """The one line a command that needs the engine prints when ``missing`` packages are absent."""
    packages = ", ".join(missing)
    return f"`kvstore {command}` runs the engine, which is not installed (no {packages}): {engine_install_hint()}"


def require_engine(command: str) -> None:
    """Refuse ``command`` (``new-model``, ``generate``, ...) when the engine extra is not installed.

    Raises
    ------
    InvalidRequest
        torch, transformers, safetensors or tokenizers cannot be imported: the reason names them and
        says ``pip install 'kvstore[engine]'``.
    """
    missing = [package for package in ENGINE_PACKAGES if not _installed(package)]
    if missing:
        raise InvalidRequest(missing_engine_reason(command, missing))


def listing(names: list[str]) -> str:
    """``f32, fp8, int4, polar2..polar6``: tier names for help texts, the PolarQuant run folded."""
    polar = [name for name in names if name.startswith("polar")]
    if len(polar) > 2:
        first = names.index(polar[0])
        names = names[:first] + [f"{polar[0]}..{polar[-1]}"] + [n for n in names[first:] if n not in polar]
    return ", ".join(names)


# ---------------------------------------------------------------------------- --tier
@dataclass(frozen=True)
class TierOption:
    """How one command takes ``--tier``: which tiers it accepts, and the tier when none is given."""

    files_only: bool  # a store or file command: the tier is a ``.coli_kv`` record format
    default: str | None

    def choices(self) -> list[str]:
        return tiers.names(in_file=True) if self.files_only else tiers.names()


class _DeprecatedAlias(argparse.Action):
    """An old option name kept for one release: stores into the new option's dest and warns."""

    def __init__(self, option_strings, dest, replacement: str, **kwargs):
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(
            f"{option_string} is deprecated: use {self.replacement}", tiers.TierSpellingDeprecated, stacklevel=2
        )
        setattr(namespace, self.dest, values)


def add_tier(
    parser: argparse.ArgumentParser,
    *,
    files_only: bool,
    default: str | None,
    what: str,
    shown_default: str | None = None,
    aliases: tuple[str, ...] = (),
) -> None:
    """``--tier NAME`` (+ the hidden, deprecated ``--codec``/``--bits`` and ``aliases`` such as ``--to``).

    ``files_only``: the command stores records, so only file tiers (``tiers.names(in_file=True)``)
    are accepted; otherwise every tier is (engine caches). ``default`` is the tier when none is
    given (None: ``args.tier`` stays None and the command decides, as ``shown_default`` tells the
    reader). ``what`` starts the help text.
    """
    option = TierOption(files_only, default)
    shown = shown_default or default
    text = f"{what}: {listing(option.choices())}" + (f" (default {shown})" if shown else "")
    parser.add_argument("--tier", metavar="NAME", help=text)
    for alias in aliases:
        parser.add_argument(alias, dest="tier", action=_DeprecatedAlias, replacement="--tier", help=argparse.SUPPRESS)
    parser.add_argument("--codec", help=argparse.SUPPRESS)  # deprecated: folded into --tier
    parser.add_argument("--bits", type=int, help=argparse.SUPPRESS)  # deprecated: folded into --tier
    parser.set_defaults(tier_option=option)


def resolve_tier(args: argparse.Namespace) -> None:
    """Replace ``args.tier`` (text) by its ``Tier``: the default when absent, None without one.

    Raises
    ------
    UnknownTier
        A name that is no tier, or old ``--codec``/``--bits`` that contradict it.
    InvalidRequest
        ``--codec``/``--bits`` without ``--tier``, or a cache-only tier where records are stored.
    """
    option: TierOption | None = getattr(args, "tier_option", None)
    if option is None:
        return
    if args.tier is None:
        if args.codec is not None or args.bits is not None:
            raise InvalidRequest(
                "--codec and --bits only qualify --tier (and are deprecated): name the tier, e.g. --tier polar3"
            )
        args.tier = tiers.get(option.default) if option.default is not None else None
        return
    try:
        tier = tiers.parse(args.tier, codec=args.codec, bits=args.bits)
    except tiers.UnknownTier as exc:
        if not (option.files_only and exc.reason.startswith("unknown tier")):
            raise
        # a file command lists the tiers it takes, not the engine's cache tiers as well
        raise tiers.UnknownTier(
            f"unknown tier {args.tier!r} (this command takes {listing(option.choices())})"
        ) from None
    if option.files_only and not tier.in_file:
        raise InvalidRequest(
            f"tier {tier.name!r} is a cache tier with no .coli_kv format of its own: "
            f"use one of {listing(option.choices())}"
        )
    args.tier = tier


# ---------------------------------------------------------------------------- --owner, --data, --json
_OWNER_HELP = {
    # commands on existing sessions
    "existing": "act as this owner: ids are per owner, other owners' sessions are invisible (default: any "
    "owner; an id several owners have is refused until you name one)",
    # commands that create a session
    "create": f"owner of the new session (default: {DEFAULT_OWNER})",
    # commands that continue a session, creating it when missing
    "either": f"act as this owner: ids are per owner, so a session this owner lacks is created for it (default: "
    f"any owner, an id several owners have refused; a session created here gets {DEFAULT_OWNER!r})",
}


OwnerRole = Literal["existing", "create", "either"]


def add_owner(parser: argparse.ArgumentParser, role: OwnerRole = "existing", text: str | None = None) -> None:
    """``--owner NAME``: ``role`` is ``existing`` (default any owner), ``create`` (default
    ``default``) or ``either`` (any owner; a session it creates gets ``default``)."""
    parser.add_argument(
        "--owner", metavar="NAME", default=DEFAULT_OWNER if role == "create" else None, help=text or _OWNER_HELP[role]
    )


def creating_owner(owner: str | None) -> str:
    """The owner a session created by an ``either`` command gets."""
    return DEFAULT_OWNER if owner is None else owner


def folder_to_write(path: str | os.PathLike, what: str, option: str = "") -> Path:
    """A folder a command writes into (created when missing), refused when a file is in the way.

    Raises
    ------
    InvalidRequest
        ``path``, or the nearest of its parents that exists, is not a folder: the reason names it
        (after ``option``, e.g. ``--data``) and ``what`` was expected there.
    """
    folder = Path(path)
    shown = f"{option} {path}" if option else str(path)
    if folder.exists() and not folder.is_dir():
        raise InvalidRequest(f"{shown}: is a file; expected {what}")
    for parent in folder.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InvalidRequest(f"{shown}: {parent} is a file; expected {what}")
            break
    return folder


def data_folder(path: str | os.PathLike) -> Path:
    """``--data DIR`` as a path, refused when a file is in the way (a missing folder is created by
    the store)."""
    return folder_to_write(path, "the session store's data folder (or a new one)", "--data")


def existing_store(path: str | os.PathLike) -> Path:
    """``--data DIR`` of a command that only works on sessions already stored: the folder must hold
    a session store, which such a command never creates.

    Raises
    ------
    InvalidRequest
        ``path`` is missing, not a folder, or holds no store: the reason names it and where stores
        come from (a typo in ``--data`` is an error, not an empty store).
    """
    from kvstore.store.context import missing_store

    data_folder(path)  # a file in the way is named as for any --data
    why = missing_store(path)
    if why is not None:
        raise InvalidRequest(
            f"--data {path}: no session store there ({why}); give the folder `kvstore serve` or "
            f"`kvstore sessions create` used (default {DEFAULT_DATA})"
        )
    return Path(path)


def require_model_folder(folder: str | os.PathLike) -> Path:
    """A model folder named on the command line, refused with one line when it is not one.

    Raises
    ------
    InvalidRequest
        ``folder`` does not exist, is a file, or holds no ``config.json``.
    """
    path = Path(folder)
    if not path.exists():
        problem = "no such folder"
    elif not path.is_dir():
        problem = "it is a file"
    elif not (path / "config.json").is_file():
        problem = "no config.json"
    else:
        return path
    raise InvalidRequest(
        f"{folder} is not a model folder ({problem}); expected a folder with config.json and safetensors "
        f"weights (`kvstore new-model {folder}` writes one)"
    )


def add_data(parser: argparse.ArgumentParser) -> None:
    """``--data DIR``: the session store's folder; ``--encrypt`` and ``--kek-file`` open it
    encrypted at rest (docs/SECURITY.md)."""
    parser.add_argument(
        "--data", metavar="DIR", default=DEFAULT_DATA, help=f"the store's data folder (default {DEFAULT_DATA})"
    )
    parser.add_argument(
        "--encrypt",
        action="store_true",
        default=None,
        help="a new store is created encrypted at rest (default: KVSTORE_ENCRYPT); a store created so is "
        "always opened so, with the key-encryption key of --kek-file, KVSTORE_KEK_FILE or KVSTORE_KEK",
    )
    parser.add_argument(
        "--kek-file",
        metavar="PATH",
        help="the file holding the store's key-encryption key (default KVSTORE_KEK_FILE; `kvstore crypto "
        "init-kek PATH` writes one)",
    )


def store_kek(args: argparse.Namespace) -> Any:
    """The key-encryption key ``--encrypt``/``--kek-file`` name (a ``kvstore.crypto.KeyProvider``),
    or None: the store then follows its folder (a keyring there: the configuration's KEK) and
    ``KVSTORE_ENCRYPT``."""
    if not getattr(args, "encrypt", None) and getattr(args, "kek_file", None) is None:
        return None
    from kvstore.crypto import provider_from_settings

    return provider_from_settings(args.kek_file)


def add_json(parser: argparse.ArgumentParser, text: str = "machine-readable output (JSON)") -> None:
    """``--json``: print the command's report as JSON instead of text."""
    parser.add_argument("--json", action="store_true", help=text)


# ---------------------------------------------------------------------------- token ids
def parse_ids(text: str, source: str = "--ids") -> list[int]:
    """``"5,6 7"`` -> ``[5, 6, 7]``: token ids separated by commas or spaces.

    Raises
    ------
    InvalidRequest
        A word that is not an integer (the message names ``source``).
    """
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise InvalidRequest(
            f"{source}: token ids must be integers separated by commas or spaces, got {text!r}"
        ) from None
