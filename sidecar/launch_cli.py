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
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import MutableMapping, Sequence
from types import FrameType
from typing import Any

from inference.core import InvalidRequestError
from sidecar.config import DEVICES, FIELD_TYPES, LOG_LEVELS, TRANSFERS, LaunchConfig, build_config

log = logging.getLogger("sidecar.launch")

SERVING_LINE = "Sidecar serving on {url}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Every default is None: a flag given on the command line wins, otherwise env, file, defaults.
    p.add_argument("--model", help="HF model directory (default: the embedded tiny model)")
    p.add_argument("--draft-model", help="draft model directory for speculative decoding")
    p.add_argument("--tp", type=int, help="tensor-parallel size: one process per rank (default 1)")
    p.add_argument("--device", choices=DEVICES, help="default auto: cuda when available")
    p.add_argument("--devices", help="GPU indices, one per rank (e.g. 1,2: rank 0 on GPU 1, rank 1 on GPU 2); "
                                     "default: rank r on GPU r")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (also SIDECAR_API_KEY)")
    p.add_argument("--transfer", choices=TRANSFERS, help="accept only this weight-transfer backend")
    p.add_argument("--bucket-mb", type=int, help="bucket size advertised to senders (default 512)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--kv-cache-bytes", type=int, help="KV cache bytes per rank (overrides the utilization rule)")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    p.add_argument("--dtype", help="auto, bfloat16, float16, float32 or model")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--config", dest="config_file", help="a JSON or TOML file of these options")
    p.add_argument("--log-level", choices=LOG_LEVELS)


def run(args: argparse.Namespace) -> int:
    cli = {name: getattr(args, name) for name in FIELD_TYPES if hasattr(args, name)}
    try:
        cfg = build_config(cli, config_file=args.config_file)
    except InvalidRequestError as e:
        print(f"sidecar launch: error: {e}", file=sys.stderr)
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
    from sidecar.driver import Driver
    from sidecar.ranks import RankFailure, RankPool

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("configuration: %s", json.dumps(cfg.public_dict(), sort_keys=True))
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
            model_dir, device = resolve_model(cfg), resolve_device(cfg)
            log.info("starting %d rank process(es) on %s for %s", cfg.tp, device, model_dir)
            pool = RankPool(cfg, model_dir, device)
            plans = pool.start()
            for plan in plans:
                log.info("memory plan: %s", describe_plan(plan))
            driver = Driver(pool, step_timeout_s=cfg.step_timeout_s, rpc_timeout_s=cfg.rpc_timeout_s,
                            max_queued=cfg.max_queued_requests)
            driver.start()
            serve(cfg, sock, driver, plans)
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


def resolve_model(cfg: LaunchConfig) -> str:
    """The model directory, checked here (config.json readable, family supported) so that a typo
    fails in a second with exit status 2 instead of after spawning every rank."""
    from inference.config import ModelConfig

    for path in (cfg.model, cfg.draft_model):
        if path is not None:
            ModelConfig.from_dir(path)
    if cfg.model is not None:
        return cfg.model
    from inference.tiny import default_model_dir

    return str(default_model_dir())


def resolve_device(cfg: LaunchConfig) -> str:
    import torch

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
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


def describe_plan(plan: dict[str, Any]) -> str:
    names = {"weights": "target", "draft_weights": "draft"}
    weights = ", ".join(f"{names.get(tag, tag)} {_mib(n)}" for tag, n in plan["weights_bytes"].items())
    return (f"rank {plan['rank']} (pid {plan['pid']}) on {plan['device']} {plan['dtype']}: weights {weights}; "
            f"KV cache {plan['kv_blocks']} blocks x {plan['block_size']} tokens = {_mib(plan['kv_bytes'])}; "
            f"max_model_len {plan['max_model_len']}")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def serve(cfg: LaunchConfig, sock: socket.socket, driver: Any, plans: list[dict[str, Any]]) -> None:
    """Serve until a signal; returns (or raises _Stop) after uvicorn has shut down."""
    import uvicorn

    from sidecar.metrics import Metrics
    from sidecar.server import ServerState, create_app

    tokenizer = None
    if plans[0]["has_tokenizer"]:
        from inference.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(plans[0]["model"])
    state = ServerState(driver, cfg, plans, Metrics(driver), tokenizer=tokenizer)
    config = uvicorn.Config(create_app(state), log_config=None, log_level=cfg.log_level, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=5)
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
            log.info("API docs at %s/docs", url)
            print(SERVING_LINE.format(url=url), flush=True)
        await task

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        sock.close()
