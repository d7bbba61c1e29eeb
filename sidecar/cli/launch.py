"""`sidecar launch`: start the rank processes, the driver and the HTTP server; stop them cleanly.

Order: bind the port (so a busy port fails before any model loads), spawn and load every rank, log
the configuration and each rank's memory plan, start the driver thread, serve HTTP and print one
line `Sidecar serving on http://HOST:PORT` (tests and scripts wait for it). SIGTERM or SIGINT stops
the HTTP server (pending calls answered 503), then the driver, then the ranks (told to stop, joined
with a timeout, then terminated and killed): no process is left and the port is free. Exit status:
0 after a signal, 1 if the ranks failed, 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from inference import envs
from inference.core import InvalidRequestError
from inference.memory.host_heap import freeze_startup_heap
from sidecar.cli.common import one_line
from sidecar.config import FIELD_TYPES, LaunchConfig, build_config, engine_default
from sidecar.log_format import fields, setup_logging

if TYPE_CHECKING:
    from sidecar.ranks.commands import RankPlan

log = logging.getLogger("sidecar.launch")

SERVING_LINE = "Sidecar serving on {url}"
# An idle kept-alive connection lives this long. Longer than clients' own idle expiry (httpx, and so
# SidecarClient: 5 s; aiohttp: 15 s) so the client always closes first: at uvicorn's 5 s both closed at
# once, and a POST sent on the connection as the server closed it failed (ReadError), which clients do
# not retry (scripts/fault_load.py met it twice in 18k requests).
KEEP_ALIVE_S = 75


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per LaunchConfig field, generated from its declaration (sidecar/config.py).

    Every flag's argparse default is None, so that only flags given on the command line override
    the environment, the config file and the defaults; --help shows the effective default instead."""
    for f in dataclasses.fields(LaunchConfig):
        kind, meta = FIELD_TYPES[f.name], f.metadata
        kwargs: dict[str, Any] = {"default": None, "help": flag_help(f)}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if "choices" in meta:  # argparse shows them as the metavar
                kwargs["choices"] = meta["choices"]
            else:
                kwargs["metavar"] = meta.get("metavar", "N" if kind in (int, float) else "TEXT")
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kwargs)
    p.add_argument("--config", dest="config_file", metavar="PATH",
                   help="a JSON or TOML file of these options (keys: the flag names without --)")


def flag_help(f: dataclasses.Field) -> str:
    """The help of one flag: its doc, its effective default and its environment variable."""
    default = f.default
    if default is None and "engine" in f.metadata:
        default = engine_default(f.metadata["engine"])
    shown = "" if default is None else f"default: {str(default).lower() if isinstance(default, bool) else default}; "
    text = f"{f.metadata['help']} ({shown}env {envs.LAUNCH_PREFIX}{f.name.upper()})"
    return text.replace("%", "%%")


def run(args: argparse.Namespace) -> int:
    cli = {name: getattr(args, name) for name in FIELD_TYPES if hasattr(args, name)}
    try:
        cfg = build_config(cli, config_file=args.config_file)
    except InvalidRequestError as e:
        print(f"sidecar launch: error: {one_line(e)}", file=sys.stderr)
        return 2
    return launch(cfg)


class _Stop(BaseException):
    """Raised by our signal handler outside uvicorn's own handling (startup, after serving)."""


class _Signals:
    """SIGTERM/SIGINT raise _Stop until `stopping`; then they are only logged (cleanup must finish)."""

    def __init__(self) -> None:
        self.stopping = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping:
            log.warning("signal %d: already stopping", sig)
            return
        self.stopping = True
        raise _Stop()


def launch(cfg: LaunchConfig) -> int:
    from sidecar.ranks.driver import Driver
    from sidecar.ranks.pool import RankFailure, RankPool

    started = time.monotonic()
    setup_logging(cfg.log_level, cfg.log_format, "http")
    log.debug("configuration: %s", json.dumps(cfg.public_dict(), sort_keys=True))
    pool: RankPool | None = None
    driver: Driver | None = None
    code = 0
    with _Signals() as signals:
        try:
            sock = bind(cfg.host, cfg.port)
            visible = place_ranks(cfg, os.environ)
            if visible is not None:
                log.info("ranks on GPUs %s: CUDA_VISIBLE_DEVICES=%s (rank r reports cuda:r of these)",
                         cfg.devices, visible)
            cfg, model_dir = resolve_model(cfg, os.environ)  # HF_HUB_CACHE / HF_HOME: where ids are found
            device = rank_device(cfg)
            log.debug("starting %d rank process(es) on %s for %s", cfg.tp, device, model_dir)
            pool = RankPool(cfg, model_dir, device)
            plans = pool.start()
            for plan in plans:
                log.debug("memory plan: %s", describe_plan(plan))
            driver = Driver(pool, step_timeout_s=cfg.step_timeout_s, rpc_timeout_s=cfg.rpc_timeout_s,
                            max_queued=cfg.max_queued_sequences,
                            hold_while_asleep=cfg.hold_while_asleep)
            driver.start()
            serve(cfg, sock, driver, plans, started)
        except _Stop:
            log.info("signal received: stopping")
        except RankFailure as e:
            log.error("the rank processes failed: %s", e)
            code = 1
        except InvalidRequestError as e:
            log.error("bad configuration: %s", e)
            code = 2
        except OSError as e:
            log.error("cannot serve on %s:%s: %s", cfg.host, cfg.port, e)
            code = 1
        finally:
            signals.stopping = True
            if driver is not None:
                driver.stop()
            if pool is not None:
                pool.close()
            log.info("stopped")
    return code


def bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP (not this one's 0); accepted
    # connections inherit it from the listener, else a response's header and body writes meet the
    # client's delayed ACK: ~40 ms per call.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def resolve_model(cfg: LaunchConfig, env: Mapping[str, str]) -> tuple[LaunchConfig, str]:
    """The model directory, checked here (config.json readable, family supported) so that a typo
    fails in a second with exit status 2 instead of after spawning every rank. A model id (ORG/NAME)
    is found in the local Hugging Face cache (inference/models/hub_cache.py); a draft model's id is
    replaced by its directory in the config the ranks get (--model stays as given: the served name)."""
    from inference.models.hf_config import read_model_config
    from inference.models.hub_cache import resolve_model_dir

    model_dir = resolve_model_dir(cfg.model, env) if cfg.model is not None else None
    if cfg.draft_model is not None:
        cfg = dataclasses.replace(cfg, draft_model=resolve_model_dir(cfg.draft_model, env, "draft_model"))
    for path in (model_dir, cfg.draft_model):
        if path is not None:
            read_model_config(path)
    for field, adapter in (("lora", cfg.lora), ("draft_lora", cfg.draft_lora)):
        if adapter is None:
            continue
        from inference.models.lora_adapter import read_adapter

        read_adapter(adapter)  # a bad adapter fails here, before any rank spawns
        cfg = dataclasses.replace(cfg, **{field: str(Path(adapter).resolve())})
    if cfg.tokenizer is not None and not (Path(cfg.tokenizer) / "tokenizer.json").is_file():
        raise InvalidRequestError("tokenizer", f"{cfg.tokenizer} holds no tokenizer.json: give the directory of "
                                               "the model's tokenizer, or leave --tokenizer out to use the model's")
    if model_dir is not None:
        return cfg, model_dir
    from inference.models.tiny import default_model_dir

    return cfg, str(default_model_dir())


def rank_device(cfg: LaunchConfig) -> str:
    """The device of every rank (--device checked, "auto" resolved); no GPU at all is a one-line error
    naming --device, too few for --tp one naming --tp."""
    import torch

    from sidecar.cli.common import check_device

    device = check_device(cfg.device, cfg.tp)
    if device == "cuda":
        count = torch.cuda.device_count()
        if count < cfg.tp:
            raise InvalidRequestError("tp", f"--tp {cfg.tp} needs {cfg.tp} GPUs, {count} visible")
    return device


def place_ranks(cfg: LaunchConfig, env: MutableMapping[str, str]) -> str | None:
    """Apply --devices: every rank takes cuda:<rank> of the GPUs it sees, so the listed GPUs become
    the only visible ones, in rank order (CUDA_VISIBLE_DEVICES, inherited by the spawned ranks).
    Returns the value set, or None without --devices. Must run before the ranks are spawned."""
    indices = cfg.device_indices
    if indices is None:
        return None
    current = env.get("CUDA_VISIBLE_DEVICES")
    count = 0
    if current is None:
        import torch

        count = torch.cuda.device_count()
    value = visible_devices(indices, current, count)
    env["CUDA_VISIBLE_DEVICES"] = value
    return value


def visible_devices(indices: Sequence[int], current: str | None, count: int) -> str:
    """The CUDA_VISIBLE_DEVICES value that shows exactly the GPUs `indices`, in that order. Indices
    count among the GPUs visible now: the entries of `current` when it is set, else `count` GPUs."""
    if current is not None:
        entries = [e.strip() for e in current.split(",") if e.strip()]
    else:
        entries = [str(i) for i in range(count)]
    missing = [i for i in indices if i >= len(entries)]
    if missing:
        where = f"CUDA_VISIBLE_DEVICES={current!r} shows" if current is not None else "this machine has"
        raise InvalidRequestError("devices", f"GPU {missing[0]} does not exist: {where} {len(entries)} GPU(s)")
    return ",".join(entries[i] for i in indices)


def describe_plan(plan: RankPlan) -> str:
    names = {"weights": "target", "draft_weights": "draft"}
    weights = ", ".join(f"{names.get(tag, tag)} {_mib(n)}" for tag, n in plan.weights_bytes.items())
    return (f"rank {plan.rank} (pid {plan.pid}) on {plan.device} {plan.dtype}: weights {weights}; "
            f"KV cache {plan.kv_blocks} blocks x {plan.block_size} tokens = {_mib(plan.kv_bytes)}; "
            f"max_model_len {plan.max_model_len}; {plan.num_threads} torch thread(s); "
            f"warm-up {plan.warm_up_s:.1f} s")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def event_loop() -> tuple[asyncio.AbstractEventLoop, str]:
    """The server's event loop and uvicorn's HTTP protocol: uvloop's loop and httptools' parser when both
    are installed (the server extra brings them: 0.2 ms off a control message's HTTP share on the CPU,
    docs/dev/benchmark-log.md), else asyncio's loop and h11 (pure Python, always there)."""
    try:
        import httptools  # noqa: F401
        import uvloop
    except ImportError:
        return asyncio.new_event_loop(), "h11"
    return uvloop.new_event_loop(), "httptools"


def http_protocol(cfg: LaunchConfig, http: str) -> type:
    """uvicorn's protocol for `http` (httptools, or h11 without the server extra) bounded by the
    connection limits (sidecar/api/connection.py): the same bounds whichever parser serves."""
    from sidecar.api.connection import ConnectionLimits, ensure_descriptors, protocol_class

    ensure_descriptors(cfg.max_connections)
    return protocol_class(ConnectionLimits(cfg.max_header_kb << 10, cfg.header_timeout_s, KEEP_ALIVE_S,
                                           cfg.max_connections), http)


def start_line(cfg: LaunchConfig, url: str, plans: list[RankPlan], seconds: float, warm_up_s: float) -> str:
    """The one INFO line of a start: where, what, how much memory, how it syncs, the kernels' warm-up; the
    full configuration is logged at debug level."""
    head = plans[0]
    weights = sum(head.weights_bytes.values())
    draft = f" + draft {cfg.draft_model}" if cfg.draft_model else ""
    return (f"serving {head.model}{draft} at {url}, ready in {seconds:.1f} s (warm-up {warm_up_s:.1f} s): "
            f"{head.device} {head.dtype}, "
            f"tp {len(plans)}"
            f"{f', dp rank {cfg.dp_rank}' if cfg.dp_rank else ''}; per rank weights {_mib(weights)}, KV cache "
            f"{head.kv_blocks} blocks x {head.block_size} tokens ({_mib(head.kv_bytes)}), max_model_len "
            f"{head.max_model_len}; weight sync over {cfg.transfer or 'the backend the trainer picks'}; API key "
            f"{'required' if cfg.api_key else 'none'} (--log-level debug logs the full configuration)")


def serve(cfg: LaunchConfig, sock: socket.socket, driver: Any, plans: list[RankPlan],
          started: float | None = None) -> None:
    """Serve until a signal; returns (or raises _Stop) after uvicorn has shut down. `started`: the
    monotonic time the launch began (its start line says how long it took)."""
    import uvicorn

    from sidecar.api.app import ServerState, create_app
    from sidecar.api.metrics import Metrics

    tokenizer = None
    if plans[0].has_tokenizer:
        from inference.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(cfg.tokenizer or plans[0].model)
    state = ServerState(driver, cfg, plans, Metrics(driver), tokenizer=tokenizer)
    loop, http = event_loop()
    app = create_app(state)
    state.gc_frozen = freeze_startup_heap().objects  # this process serves until it exits (host_heap.py)
    # uvicorn's own start and stop lines are noise beside ours unless debugging
    config = uvicorn.Config(app, log_config=None, access_log=False,
                            log_level="warning" if cfg.log_level == "info" else cfg.log_level,
                            lifespan="off", timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S,
                            http=http_protocol(cfg, http), h11_max_incomplete_event_size=cfg.max_header_kb << 10)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            # Pending generation calls may wait for a wake-up that will never come: answer them now.
            loop.call_soon_threadsafe(driver.stop, 0.0)

    server = Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            took = time.monotonic() - (started or time.monotonic())
            # the start-up pass that compiled what rollouts run (0 on CPU): the rank that took longest
            warm_up_s = max(plan.warm_up_s for plan in plans)
            log.info(start_line(cfg, url, plans, took, warm_up_s),
                     extra=fields(event="start", url=url, seconds=round(took, 3), warm_up_s=round(warm_up_s, 3),
                                  http=http))
            log.debug("API docs at %s/docs", url)
            print(f"{SERVING_LINE.format(url=url)} (warm-up {warm_up_s:.1f} s)", flush=True)
        await task

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        sock.close()
