"""One exception hierarchy, one HTTP map: every error class of the project answers a decided status.

Every module of the project is imported and every subclass of ``KVStoreError`` found is checked:
it maps (explicitly, or through a base it specializes) to a 4xx/5xx in ``kvstore.api.errors``,
carries no HTTP knowledge of its own, says in its docstring what happened, and subclasses a
built-in error besides ``KVStoreError``.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest

from kvstore.api import errors as api_errors
from kvstore.api.errors import HTTP_STATUS, dotted_name, http_status, status_entry
from kvstore.errors import KVStoreError

#: The packages of the project (their folders); every module in them is imported.
PACKAGES = (
    "kvstore.formats",
    "kvstore.migrations",
    "kvstore",
    "kvstore.gpu",
    "kvstore.engine",
    "kvstore.api",
    "kvstore.cli",
    "kvstore.connectors",
)
#: Where each layer's errors are defined (imported here so the walk below finds them by name).
ERROR_MODULES = (
    "kvstore.formats.errors",
    "kvstore.migrations.errors",
    "kvstore.errors",
    "kvstore.gpu.errors",
    "kvstore.engine.errors",
    "kvstore.api.errors",
)


# Modules that only import inside a host program's own environment (the vLLM connector subclasses
# vLLM's base class, and vLLM lives in its own virtualenv): they define no error of their own.
RUNS_INSIDE = {"kvstore.connectors.vllm"}


def _import_everything() -> None:
    for name in PACKAGES:
        package = importlib.import_module(name)
        if not hasattr(package, "__path__"):
            continue
        # the package's own folder only: a source checkout also maps the repository root into kvstore
        for module in pkgutil.walk_packages([os.path.dirname(package.__file__)], prefix=f"{name}."):
            if module.name.rsplit(".", 1)[-1] == "__main__":  # importing a __main__ runs it
                continue
            if module.name in RUNS_INSIDE:
                continue
            importlib.import_module(module.name)


def project_errors() -> list[type[KVStoreError]]:
    """Every subclass of KVStoreError defined in a ``kvstore`` module, the root included."""
    _import_everything()
    found, todo = [], [KVStoreError]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] == "kvstore" and cls not in found:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=dotted_name)


ERRORS = project_errors()


def test_the_walk_finds_every_layers_errors():
    modules = {cls.__module__ for cls in ERRORS}
    assert set(ERROR_MODULES) <= modules, set(ERROR_MODULES) - modules
    assert len(ERRORS) >= 40


def test_each_error_is_defined_once():
    names = [cls.__name__ for cls in ERRORS]
    assert sorted(name for name in names if names.count(name) > 1) == []


@pytest.mark.parametrize("cls", ERRORS, ids=dotted_name)
def test_every_error_maps_to_a_decided_4xx_or_5xx(cls):
    status = http_status(cls)
    assert 400 <= status < 600
    if cls is not KVStoreError:
        # decided for this family, not the root's last-resort 400
        assert status_entry(cls) is not KVStoreError, (
            f"{dotted_name(cls)} has no entry (nor a base with one) in HTTP_STATUS"
        )


@pytest.mark.parametrize("cls", ERRORS, ids=dotted_name)
def test_errors_know_no_http_and_say_what_happened(cls):
    assert not any("http_status" in vars(base) for base in cls.__mro__), "the HTTP map lives in kvstore.api.errors"
    assert cls.__doc__ and cls.__doc__.strip() and "__doc__" in vars(cls), f"{cls.__name__} needs a docstring"
    if cls is not KVStoreError:
        builtins = [
            base
            for base in cls.__mro__
            if base.__module__ == "builtins" and base not in (Exception, BaseException, object)
        ]
        assert builtins, (
            f"{cls.__name__} should also subclass the matching built-in (ValueError, KeyError, OSError, ...)"
        )


def test_every_map_entry_names_an_existing_error():
    for key in HTTP_STATUS:
        if isinstance(key, str):
            module, _, name = key.rpartition(".")
            cls = getattr(importlib.import_module(module), name)
            assert dotted_name(cls) == key
        else:
            cls = key
        assert issubclass(cls, KVStoreError) and cls in ERRORS


def test_the_statuses_are_the_ones_the_api_documents():
    # The map as the errors carried it before it moved here (behaviour unchanged), plus the
    # classes that only inherited the base's 400.
    expected = {
        "KVStoreError": 400,
        "FormatError": 422,
        "BadHeader": 422,
        "UnknownTier": 422,
        "GeometryMismatch": 409,
        "CodecMismatch": 409,
        "MigrationError": 400,
        "NoMigrationPath": 400,
        "IndexSchemaError": 503,
        "JournalWriteError": 507,
        "JournalLocked": 409,
        "JournalClosed": 400,
        "PathRefused": 400,
        "SessionNotFound": 404,
        "SessionExists": 409,
        "InvalidSessionId": 400,
        "InvalidRequest": 400,
        "BudgetExceeded": 507,
        "FingerprintMismatch": 409,
        "IntegrityError": 409,
        "SessionDamaged": 409,
        "IndexFull": 507,
        "IndexIOError": 507,
        "ConfigError": 400,
        "AttentionInputError": 422,
        "BackendUnavailable": 503,
        "ModelConfigError": 422,
        "WeightsError": 422,
        "TierUnsupported": 422,
        "CacheError": 409,
        "GenerationError": 422,
        "CacheLayoutUnsupported": 422,
        "ConversationMismatch": 409,
        "RestoreFailed": 503,
        "BodyTooLarge": 413,
        "DuplicateJSONKey": 422,
        "NonFiniteValues": 422,
        "ServiceBusy": 429,
        "JobQueueFull": 429,
        "SessionBusy": 429,
        "UnsupportedMediaType": 415,
        "Unauthorized": 401,
        "JobNotFound": 404,
        "EngineNotLoaded": 503,
    }
    by_name = {cls.__name__: cls for cls in ERRORS}
    assert {name: http_status(by_name[name]) for name in expected} == expected


def test_instances_and_subclasses_resolve_along_the_mro():
    from kvstore.errors import IntegrityError, SessionDamaged

    class Specific(SessionDamaged):
        """A test-only refinement: inherits IntegrityError's status."""

    assert http_status(Specific("x")) == http_status(IntegrityError) == 409
    assert status_entry(Specific) is IntegrityError
    with pytest.raises(TypeError):
        http_status(ValueError)
    assert api_errors.__all__ and "http_status" in api_errors.__all__
