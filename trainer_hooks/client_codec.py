"""The JSON shapes of `SidecarClient`'s bodies (trainer_hooks/client.py), both ways, apart from its HTTP:
Python objects -> request bodies (sampling params, the sender's digest records, finish's compact digests,
a manifest's layout key) and a /generate answer -> RequestOutput.

Pure functions of their arguments: no httpx, no torch, no I/O (inference.core's shared types only), so
the fleet's sync builds the same finish body as the client, from the same code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inference.core import CompletionOutput, FinishReason, RequestOutput, SamplingParams


def manifest_layout(manifest: Any) -> str | None:
    """The layout key of a manifest that lists its tensors (None otherwise)."""
    return manifest.get("layout") if isinstance(manifest, dict) and "tensors" in manifest else None


def finish_digests(manifest: Any, records: Any) -> Any:
    """What finish takes from the sender's records. With the rule the manifest named: the compact form
    {"algorithm", "digests": one hex string per tensor in manifest order} (the start manifest already
    carried names, dtypes and shapes; about a quarter of the bytes to encode, check and rebuild), or the
    full records when the records are not the manifest's tensors in order. Without a rule: the bare
    records (the sidecar then assumes the session's)."""
    algorithm = manifest.get("algorithm") if isinstance(manifest, dict) else None
    tensors = records_json(records)
    if algorithm is None:
        return tensors
    specs = manifest.get("tensors")
    names = [t.get("name") for t in specs if isinstance(t, dict)] if isinstance(specs, list) else None
    if isinstance(tensors, list) and names == [r.get("name") for r in tensors]:
        return {"algorithm": algorithm, "digests": [r["digest"] for r in tensors]}
    return {"algorithm": algorithm, "tensors": tensors}


def records_json(records: Any) -> Any:
    """TensorRecords (or a Manifest) -> JSON dicts; dicts and lists of dicts pass through."""
    if hasattr(records, "to_dict"):
        return records.to_dict()
    if isinstance(records, (list, tuple)):
        return [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape), "digest": r.digest}
                if dataclasses.is_dataclass(r) else r for r in records]
    return records


def params_dict(p: Any) -> dict[str, Any]:
    """SamplingParams (tuples as lists) or a mapping -> the JSON dict of one prompt's sampling params."""
    if isinstance(p, SamplingParams):
        d = dataclasses.asdict(p)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
    return dict(p)


def request_output(i: int, o: dict[str, Any]) -> RequestOutput:
    """One entry of /generate's "outputs" -> the RequestOutput of prompt `i` (its request_id is str(i))."""
    outs = [CompletionOutput(
        index=c["index"], token_ids=c["token_ids"], logprobs=c["logprobs"],
        finish_reason=FinishReason(c["finish_reason"]) if c["finish_reason"] else None, text=c["text"],
        top_logprobs=[{int(k): v for k, v in d.items()} for d in c["top_logprobs"]] if c["top_logprobs"] else None,
        stop_reason=c.get("stop_reason"),
        weight_version_spans=[tuple(s) for s in c.get("weight_version_spans", [])]) for c in o["completions"]]
    return RequestOutput(request_id=str(i), prompt_token_ids=o["prompt_token_ids"], outputs=outs,
                         weight_version=o["weight_version"], prompt=o["prompt"],
                         num_cached_tokens=o["num_cached_tokens"])
