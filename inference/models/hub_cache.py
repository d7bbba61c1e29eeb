"""A model named by its Hugging Face id (ORG/NAME), found in the local hub cache: never downloaded.

The cache layout (huggingface_hub's): <cache>/models--ORG--NAME/refs/<revision> holds a commit hash,
and <cache>/models--ORG--NAME/snapshots/<hash>/ is the model directory (config.json, safetensors).
<cache> is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub, read through the registry
(inference/envs.py) from `env` or, unset, the process's environment. Read here directly, so no
dependency is needed. `resolve_model_dir` is the one rule for every entry point: `sidecar launch
--model/--draft-model` and the in-process `LLM(...)`. A name that is neither a directory nor a cached
id is an InvalidRequestError naming the field, the id and the cache directory, saying what is accepted
and how to get a directory. Torch-free: `sidecar launch` checks its model before any rank starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from inference import envs
from inference.core import InvalidRequestError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where huggingface_hub keeps its downloads, by the same rule it uses (`env`: os.environ if None)."""
    cache = envs.HF_HUB_CACHE.get(env)
    if cache is not None:
        return Path(cache).expanduser()
    home = envs.HF_HOME.get(env)
    if home is not None:
        return Path(home).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def is_model_id(name: str) -> bool:
    """ORG/NAME as the hub spells ids (not an existing path)."""
    return _REPO_ID.fullmatch(name) is not None and not Path(name).exists()


def cached_snapshot(model_id: str, env: Mapping[str, str] | None = None, revision: str = "main") -> Path | None:
    """The snapshot directory of `model_id` at `revision` in the local cache, None when not there."""
    repo = hub_cache_dir(env) / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / revision
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        return snapshot if (snapshot / "config.json").is_file() else None
    snapshots = repo / "snapshots"  # no ref (a cache written by hand or pruned): the only snapshot, if one
    found = [p for p in snapshots.iterdir() if (p / "config.json").is_file()] if snapshots.is_dir() else []
    return found[0] if len(found) == 1 else None


def resolve_model_dir(name: str, env: Mapping[str, str] | None = None, field: str = "model") -> str:
    """A model directory for `name`: the directory itself, or the cached snapshot of a model id. An
    InvalidRequestError naming `field` otherwise (what is supported, how to get a directory)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if is_model_id(name):
        snapshot = cached_snapshot(name, env)
        if snapshot is not None:
            return str(snapshot)
        where = f"{name!r} is not in the local Hugging Face cache ({hub_cache_dir(env)})"
    else:
        where = f"{name!r} is not a directory"
    raise InvalidRequestError(field, f"{where}. Supported: a local model directory with config.json and "
                                     "*.safetensors, or a model id (ORG/NAME) already in the local Hugging Face "
                                     "cache (nothing is downloaded). Get a directory with `huggingface-cli "
                                     f"download {name if is_model_id(name) else 'ORG/NAME'} --local-dir DIR` "
                                     "and pass DIR")
