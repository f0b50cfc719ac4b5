"""The second process of the resume-equivalence test: restore a ``.coli_kv`` file, continue.

Usage: ``python resume_worker.py MODEL_DIR ROWS.coli_kv TIER CONTEXT_JSON MAX_NEW`` — prints one
JSON object: the generated tokens and the prefilled/reused counts.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from kvstore.engine import Engine

    model_dir, rows_path, tier, context_json, max_new = argv
    engine = Engine.from_folder(model_dir, tier=tier)
    restored = engine.restore_file(rows_path)
    result = engine.generate(json.loads(context_json), max_new_tokens=int(max_new), stop_tokens=())
    print(
        json.dumps(
            {
                "restored": restored,
                "tokens": result.tokens,
                "prefilled": result.prefilled_tokens,
                "reused": result.reused_tokens,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
