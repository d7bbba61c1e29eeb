"""SIDECAR_VERIFY_KEYS_ONCE (inference/layers/verify_attention.py) through the whole engine on CPU: the
triton attention backend in Triton's interpreter, the tiny model drafting for itself, so every verify
launch holds k + 1 rows of each sequence and the draft's catch-up rows run the same kernel. Greedy output
with the draft must equal the target's alone. The switch is read at import, so each run is a child
process. The kernel's own cases (directions, splits, padded rows, 16 rows, the rotation) are in
tests/test_triton_attention_rows.py and tests/test_attention_rope.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run in Triton's interpreter (as the other files)

CHILD = textwrap.dedent("""
    import json
    from inference.core import SamplingParams
    from inference.layers.triton_attention import TritonAttentionTiles
    from inference.engine.llm import LLM
    from inference.models.tiny import default_model_dir

    model = str(default_model_dir())
    prompts = ["hello world", "the quick brown fox jumps", "a"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = LLM(model, device="cpu", attention_backend="triton", max_model_len=128)
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, greedy)]
    spec = LLM(model, device="cpu", attention_backend="triton", max_model_len=128, draft_model=model,
               num_speculative_tokens=3)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)]
    print(json.dumps({"keys_once": TritonAttentionTiles().verify_keys_once, "equal": got == want,
                      "proposed": spec.spec_stats.proposed, "accepted": spec.spec_stats.accepted}))
""")


@pytest.mark.slow
def test_greedy_with_a_draft_equals_the_target_alone_with_keys_once() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "SIDECAR_VERIFY_KEYS_ONCE": "1", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600, env=env,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["keys_once"] is True, got  # the switch reached the backend's tiles
    assert got["equal"], got
    assert got["proposed"] > 0 and got["accepted"] == got["proposed"], got  # the target drafting itself


def test_the_batch_invariant_tiles_keep_the_decode_kernel() -> None:
    """The invariant mode sums a verify row's keys as plain decode does: never the keys-once kernel."""
    pytest.importorskip("triton")
    from inference.layers.triton_attention import TritonAttention, TritonAttentionTiles

    tiles = TritonAttentionTiles(verify_keys_once=True)
    assert tiles.batch_invariant().verify_keys_once is False
    assert TritonAttention(tiles).for_decode_rows(5).tiles.verify_keys_once is True
    assert TritonAttention(tiles).batch_invariant().tiles.verify_keys_once is False


@pytest.mark.parametrize("descending", [False, True])
def test_keys_once_with_a_sliding_window_matches_the_reference(descending: bool) -> None:
    """A window of 7 keys over contexts crossing several 16-key tiles and 4 splits: each row attends only
    its own window, the earliest row's window starting first; padded rows around the sequences."""
    pytest.importorskip("triton")
    import inference.layers.triton_attention as ta
    from inference.batch import AttentionMetadata
    from inference.layers.attention import ReferenceAttention
    from tests.test_triton_attention import SMALL_TILES, make_batch, tolerance
    from tests.test_triton_attention_rows import PAD, verify_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    b = make_batch([5, 5, 3], [19, 5, 40], 8, 2, 32, 8, torch.float32, seed=41, table_width=6)
    rows, order = verify_rows(b, descending=descending, pads=True)
    real = [r for r, t in enumerate(order) if t != PAD]
    idx = torch.tensor(real, device=rows.q.device)
    ctx = rows.meta.context_lens_host
    ref_meta = AttentionMetadata.build([1] * len(real), [ctx[r] for r in real], rows.meta.slot_mapping[idx],
                                       [rows.meta.block_tables[r].tolist() for r in real], rows.meta.block_size,
                                       device)
    scale = 32 ** -0.5
    want = ReferenceAttention().forward(rows.q[idx], rows.k[idx], rows.v[idx], rows.k_cache.clone(),
                                        rows.v_cache.clone(), ref_meta, scale, 7)
    tiles = ta.TritonAttentionTiles(**SMALL_TILES, num_splits=4, decode_split_tiles=1, verify_keys_once=True)
    backend = ta.TritonAttention(tiles)
    assert backend.plan(rows.q, rows.k_cache, rows.meta).keys_once
    got = backend.forward(rows.q, rows.k, rows.v, rows.k_cache.clone(), rows.v_cache.clone(), rows.meta, scale, 7)
    torch.testing.assert_close(got[idx], want, **tolerance(torch.float32))
