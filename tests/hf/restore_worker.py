"""Restore kvstore sessions into a transformers cache in a fresh process and continue them.

Usage: ``python restore_worker.py SPEC.json`` where the spec holds ``data`` (the store folder),
``model`` (the model folder), ``owner`` and ``jobs``: ``{"session", "turn", "new_tokens",
"rows_like", "name"}`` (``rows_like`` and ``name`` optional; ``name`` defaults to the session). For
each job the session is restored, the next input built with ``restored.input_ids(turn)`` (an empty
turn hands the last stored token back) and ``new_tokens`` greedy tokens generated. Prints one JSON
line: per job the generated tokens, ``restored_rows`` (the cache restored), ``reused`` (the
restore's report once the input was built), ``input_tokens``, ``prefilled`` (tokens the model's
first forward actually embedded, counted by a hook) and, with ``rows_like``, the relative L2 error
of the restored rows against those of that session.
"""

from __future__ import annotations

import json
import sys

import torch


def main(spec_path: str) -> int:
    from transformers import AutoModelForCausalLM

    from kvstore.engine import hf
    from kvstore.store import SessionStore

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    embedded: list[int] = []
    model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: embedded.append(int(args[0].shape[-1])))
    results = []
    with SessionStore(spec["data"]) as store:
        restored_rows = {}
        for job in spec["jobs"]:
            restored = hf.restore(store, job["session"], model, owner=spec["owner"])
            L, R = hf.cache_rows(model, restored.cache)
            restored_rows[job["session"]] = (torch.from_numpy(L), torch.from_numpy(R))
            rows_held = hf.cache_length(restored.cache)
            ids = restored.input_ids(job["turn"])
            hf.prefill_length(restored.cache, ids)  # what hf-chat checks before generate: never the input twice
            embedded.clear()
            out = model.generate(
                ids, max_new_tokens=job["new_tokens"], do_sample=False, **hf.cache_kwargs(model, restored.cache)
            )
            result = {
                "name": job.get("name", job["session"]),
                "session": job["session"],
                "tier": restored.tier.describe(),
                "restored_rows": rows_held,
                "reused": restored.reused_tokens,
                "input_tokens": int(ids.shape[1]),
                "prefilled": embedded[0],
                "tokens": out[0, ids.shape[1] :].tolist(),
            }
            like = job.get("rows_like")
            if like is not None:
                mine, theirs = restored_rows[job["session"]], restored_rows[like]
                result["rel_l2"] = [float((a - b).norm() / b.norm()) for a, b in zip(mine, theirs)]
            results.append(result)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
