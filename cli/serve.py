"""``kvstore serve``: the HTTP service (FastAPI under uvicorn) over a data folder, optionally with the
bundled engine (``--model DIR``) behind ``POST /sessions/{id}/generate``.

The listening socket is bound first, before the store is opened or anything is written: a port that
is out of range, taken or not allowed is one line and exit 2, naming the address and what to do.
Once the server listens it prints where (``kvstore: serving http://127.0.0.1:8000 ...``) and where
its API keys come from. A data folder without ``keys.json`` gets one with a first key for owner
``default``, printed once; a later start says how many keys the file holds and how to make another
(``kvstore keys create``: a key is never shown twice). With ``KVSTORE_API_KEYS`` set the service
takes its keys from there and creates no ``keys.json`` (one that exists is read too).
A start that fails creates no key and prints none, and exits 2.

The only command that imports :mod:`kvstore.api` (when it runs): the CLI is the one part above it.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore import config
from kvstore.cli import options, store_cmd
from kvstore.errors import InvalidRequest
from kvstore.units import parse_size

if TYPE_CHECKING:
    from kvstore.api.settings import Settings
    from kvstore.keys import KeyFile

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
BACKLOG = 2048  # uvicorn's own default
#: Settings fields given as ``--name`` flags (their defaults are Settings'; docs/API.md "Limits").
LIMITS = {
    "lock_timeout": (float, "seconds a request waits for a busy session before 409 JournalLocked (default 10)"),
    "session_waiters": (int, "requests of one owner that may wait for one session; one more gets 429 (default 16)"),
    "max_jobs": (int, "park/unpark/migrate jobs queued or running at once; one more gets 429 (default 64)"),
    "max_jobs_per_owner": (int, "the same, for one owner's jobs (default 16)"),
    "max_sessions_per_owner": (
        int,
        "sessions one owner may have; one more create or fork gets 409 TooManySessions, nothing created "
        "(default 100000; with --index, counted across every replica)",
    ),
    "expiry_sweep": (
        float,
        "seconds between sweeps deleting expired sessions (their files or objects, as a DELETE); expired "
        "sessions are refused at once either way; 0: no sweep (default 60)",
    ),
    "header_timeout": (
        float,
        "seconds a connection may take to send a request's headers before it is answered 408 and closed (default 10)",
    ),
}
#: Settings fields of the engine's scheduler, given as ``--name`` flags (docs/SERVE.md "Limits").
SERVING = {
    "max_new_tokens": (int, "with --model: the most tokens one turn may ask for (default 4096)"),
    "max_batch": (int, "with --model: turns decoded together, the engine's slots (default 16 on a GPU, 8 on the CPU)"),
    "arena_rows": (
        int,
        "with --model: rows of the decode arena reserved at start; growing past them stalls one step "
        "(default 4096 a slot on a GPU, 0 on the CPU)",
    ),
    "step_tokens": (
        int,
        "with --model: the most tokens one decode step runs; short prompts join the batch inside a step "
        "instead of a prefill forward of their own (default 512 where steps replay CUDA graphs, else 0: off)",
    ),
    "max_queue": (int, "with --model: turns in flight beyond the slots; one more gets 429 (default 64)"),
    "max_turns_per_owner": (int, "with --model: turns one owner may have in flight; one more gets 429 (default 8)"),
    "turn_deadline": (float, "with --model: seconds a turn may run before it is stopped (default 600)"),
    "torch_threads": (
        int,
        "with --model: torch's intra-op threads (default 1 with --device cpu, else torch's own)",
    ),
}


def _log_to_stderr(level: str) -> None:
    """kvstore's own log lines (reconcile actions, the engine, each generate turn's reuse) on stderr."""
    import logging

    logger = logging.getLogger("kvstore")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.api.settings import DEFAULT_MAX_BODY_BYTES, Settings
    from kvstore.store.index import DEFAULT_MAP_SIZE

    given = [("--tier", args.tier), ("--device", args.device), ("--dtype", args.dtype)]
    given += [("--pool-size", args.pool_size), ("--host-pool-size", args.host_pool_size)]
    given += [("--" + name.replace("_", "-"), getattr(args, name)) for name in SERVING]
    engine_flags = [flag for flag, value in given if value is not None]
    if args.model is None and engine_flags:
        raise InvalidRequest(
            f"{', '.join(engine_flags)} only apply to the engine: give its model folder with --model DIR"
        )
    if args.model is not None:
        options.require_engine("serve --model")
        options.require_model_folder(args.model)
    index_url = store_cmd.optional_index_url(args)
    blobs_url = store_cmd.optional_blobs_url(args)
    if index_url is not None or blobs_url is not None:
        store_cmd.shared_modules()
    _check_kek(args, shared=index_url is not None)
    settings = Settings(
        data_dir=options.data_folder(args.data),
        budget_bytes=parse_size(args.budget),
        hard_limit_bytes=parse_size(args.hard_limit),
        max_body_bytes=parse_size(args.max_body) or DEFAULT_MAX_BODY_BYTES,
        max_inflight_bytes=parse_size(args.max_inflight_bytes),
        reject_nonfinite=args.reject_nonfinite,
        **{name: getattr(args, name) for name in (*LIMITS, *SERVING) if getattr(args, name) is not None},
        map_size=parse_size(args.index_size) or DEFAULT_MAP_SIZE,
        encrypt=bool(args.encrypt),
        kek_file=Path(args.kek_file) if args.kek_file is not None else None,
        model_dir=Path(args.model) if args.model is not None else None,
        tier=args.tier.name if args.tier is not None else config.ENGINE_TIER.value,
        device=args.device or "cpu",
        dtype=args.dtype,
        index_url=index_url,
        blobs_url=blobs_url,
        **({"lease_ttl": args.lease_ttl} if args.lease_ttl is not None else {}),
        cache_bytes=parse_size(args.cache_size),
        pool_bytes=parse_size(args.pool_size),
        host_pool_bytes=parse_size(args.host_pool_size) or 0,
    )
    # a socket bound by the caller (tests, socket activation), else ours: bound before anything else
    sockets = [socket.socket(fileno=args.fd)] if args.fd is not None else _bind(args.host, args.port)
    try:
        return _serve(args, settings, sockets)
    finally:
        for sock in sockets:
            sock.close()


def _serve(args: argparse.Namespace, settings: Settings, sockets: list[socket.socket]) -> int:
    """Run the service on ``sockets`` until it stops; say where it listens and where its keys are."""
    import logging

    import uvicorn

    from kvstore.api.connections import HeaderDeadline, raise_descriptor_limit
    from kvstore.api.main import create_app

    _log_to_stderr(args.log_level)
    app = create_app(settings, first_key=False)
    raised = raise_descriptor_limit()  # the default 1,024 descriptors is a fraction of what a server holds
    if raised is not None and raised[0] != raised[1]:
        logging.getLogger("kvstore").info("open-file limit raised from %d to %d", *raised)
    server_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
        http=HeaderDeadline,  # connections whose headers do not arrive in time are closed
    )
    server_config.header_timeout = settings.header_timeout  # type: ignore[attr-defined]  # read by HeaderDeadline
    bound = sockets[0].getsockname()
    url = _url(bound[0] if args.fd is not None else args.host, bound[1])

    def listening() -> None:
        print(f"kvstore: serving {url} with the data folder {settings.data_dir} (Ctrl-C stops it)")
        # a replica's keys are the shared index's (kvstore keys create --index): no keys.json to start
        if not settings.shared:
            _print_keys(settings.data_dir, settings.api_keys_env)
        sys.stdout.flush()

    server = _listening_server(server_config, on_listening=listening)
    try:
        server.run(sockets=sockets)
    except SystemExit as exc:  # uvicorn's way out of a failed startup; it logged the cause
        if server.started or exc.code in (None, 0):
            raise
        where = f"socket {args.fd}" if args.fd is not None else url
        raise InvalidRequest(f"the service did not start on {where} (the log above says why)") from None
    if server.failure is not None:
        raise server.failure
    return 0


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names (as uvicorn's own would be), bound before
    the service opens its store: a port that cannot be had stops the start with nothing written.

    Raises
    ------
    InvalidRequest
        The port is in use, not allowed, or ``host`` is not an address of this machine: one line
        naming the address and what to do.
    """
    where = f"{host}:{port}"
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidRequest(
            f"--host {host}: not a name or address this machine can listen on ({exc.strerror})"
        ) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # every address on the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(BACKLOG)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            reason = (
                f"cannot listen on {where}: the port is in use (another `kvstore serve`, such as `make run`, "
                f"may hold it); stop that one, or give another port with --port"
            )
        elif exc.errno == errno.EACCES:
            reason = f"cannot listen on {where}: not allowed (ports below 1024 need privileges); give another port with --port"
        elif exc.errno == errno.EADDRNOTAVAIL:
            reason = f"cannot listen on {where}: {host} is not an address of this machine (--host)"
        else:
            reason = f"cannot listen on {where}: {(exc.strerror or str(exc)).lower()}"
        raise InvalidRequest(reason) from None
    return sockets


def _check_kek(args: argparse.Namespace, *, shared: bool = False) -> None:
    """Refuse now, with the reason and before the server starts, a store that must be opened
    encrypted (``--encrypt``, ``KVSTORE_ENCRYPT``, or a store created so) when no usable
    key-encryption key is named (docs/SECURITY.md). A shared store (``shared``) says whether it
    was created encrypted only once its index is reached, at start: here, the flags alone."""
    from kvstore.crypto import provider_from_settings
    from kvstore.crypto.keyring import Keyring

    asked = args.encrypt or args.kek_file is not None or config.ENCRYPT.get()
    if asked or (not shared and Keyring.exists(args.data)):
        provider_from_settings(args.kek_file)


def _print_keys(data_dir: Path, env_keys: str | None) -> None:
    """Say where the service's API keys come from, on stdout, once it listens.

    ``KVSTORE_API_KEYS`` set: its keys (and those of a ``keys.json`` that exists), no file created.
    Else a missing ``keys.json`` is created with a first key for ``default``, printed once; an
    existing one is counted, with how to make a key for someone who lost theirs.
    """
    from kvstore.keys import KEYS_FILE, KeyFile, env_records

    keys = KeyFile(data_dir)
    path = data_dir / KEYS_FILE
    make_one = f"`kvstore keys create --owner NAME --data {data_dir}` makes another"
    if env_keys:
        counted = f"{_keys(len(env_records(env_keys)))} from KVSTORE_API_KEYS"
        if keys.stamp() is not None:
            counted += f" and {_keys(_active(keys))} in {path}"
        print(f"kvstore: API keys: {counted}")
        return
    created = keys.first_key()
    if created is not None:
        record, key = created
        print(f"Created {path} with an API key for owner {record.owner!r} (id {record.id}; shown once, keep it):")
        print(f"  {key}")
        return
    active = _active(keys)
    if active == 0:
        print(
            f"kvstore: API keys: none active in {path}: `kvstore keys create --owner NAME --data {data_dir}` makes one"
        )
        return
    print(f"kvstore: API keys: {_keys(active)} in {path} (each shown once, when made; lost one? {make_one})")


def _active(keys: KeyFile) -> int:
    return sum(record.state() == "active" for record in keys.records())


def _keys(count: int) -> str:
    return f"{count} key" if count == 1 else f"{count} keys"


def _listening_server(config, on_listening: Callable[[], None]):
    """A uvicorn server that calls ``on_listening()`` once it has started and listens (uvicorn runs
    the app's startup before it binds, so the app itself cannot know). An exception from it stops
    the server and is kept in ``failure``."""
    import uvicorn

    class Server(uvicorn.Server):
        failure: BaseException | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)  # SystemExit when the app's startup or the bind fails
            if not self.started or self.should_exit:
                return
            try:
                on_listening()
            except Exception as exc:  # e.g. keys.json cannot be written: stop, and say why
                self.failure, self.should_exit = exc, True

    return Server(config)


def _port(text: str) -> int:
    """``--port``: a TCP port, 0..65535 (argparse reports the reason as a usage error: exit 2)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a TCP port is a number 0..65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {port}")
    return port


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the ``kvstore`` parser's subparsers."""
    p = sub.add_parser("serve", help="run the HTTP service")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument(
        "--port", type=_port, default=8000, help="TCP port to listen on, 0..65535 (default 8000; 0: any free one)"
    )
    options.add_data(p)
    store_cmd.add_shared(p)
    p.add_argument(
        "--lease-ttl",
        type=float,
        help="with --index: seconds a replica's write lease on a session lasts; a replica that dies mid-append "
        "holds the session that long (default 30)",
    )
    p.add_argument(
        "--cache-size",
        help="with --index: size budget of this replica's local cache of segment objects in --data, e.g. 20G "
        "(least recently used copies evicted; default 8G, 0 for none)",
    )
    p.add_argument(
        "--budget",
        help="soft disk budget, e.g. 50G (LRU sessions are parked, then deleted); with --index, the whole shared store's",
    )
    p.add_argument(
        "--hard-limit",
        help="hard disk limit, e.g. 60G (writes past it are refused); with --index, the whole shared store's "
        "(give every replica the same)",
    )
    p.add_argument(
        "--max-body",
        help="largest request body (default 256M); also the most an Arrow upload decodes to. JSON bodies have "
        "smaller limits per route (64K, 8M for token lists; docs/API.md 'Limits')",
    )
    p.add_argument(
        "--max-inflight-bytes",
        help="request bodies of uploads held at once, service-wide, e.g. 2G (default 1G, or four of --max-body); "
        "an upload past it gets 503 with Retry-After before its body is read",
    )
    for name, (kind, what) in (LIMITS | SERVING).items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=what)
    p.add_argument(
        "--reject-nonfinite",
        action="store_true",
        help="refuse appended rows holding NaN or infinity (422) instead of storing them as the tier's rule "
        "says (f32 values become 0, ...) and counting them in the answer's 'sanitized'",
    )
    p.add_argument(
        "--index-size",
        help="the most the session index (LMDB) may grow to, e.g. 4G (default 1G; a sparse file): past it, "
        "writes answer 507 IndexFull until the service restarts with a larger size",
    )
    p.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="least severe log lines shown (default info)"
    )
    p.add_argument(
        "--model",
        help="model folder to generate with (POST /sessions/{id}/generate); without it that endpoint answers 503",
    )
    options.add_tier(
        p, files_only=False, default=None, shown_default=config.ENGINE_TIER.value, what="the engine's cache tier"
    )
    p.add_argument("--device", help="torch device of the engine: cpu (default), cuda, cuda:1, mps")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="the engine's weights dtype (default float32)"
    )
    p.add_argument(
        "--pool-size",
        help="with --model: device memory resident sessions keep between turns, e.g. 20G (least recently used "
        "leave first; default half the free GPU memory, 1G on the CPU)",
    )
    p.add_argument(
        "--host-pool-size",
        help="with --model: pinned host memory sessions leaving the device move to, e.g. 64G (default 0: none)",
    )
    p.add_argument("--fd", type=int, help=argparse.SUPPRESS)  # an already bound socket
    p.set_defaults(func=cmd_serve)
