"""How precise a score product on raw fp8 codes would be, with the query split into e4m3 terms.

Hopper's fp8 tensor-core rate is reached only by ``wgmma`` with both operands in fp8. The fp8 tier's
codes could then be scored as they are stored (no conversion), if the query is fp8 too: per head,
a power-of-two scale putting max |q| under 448, then ``n`` e4m3 terms, each the rounding of what the
earlier ones left (``q ~ t1 + t2 + ...``: n products at twice f16's rate). This emulates that in
float64 on the CPU (no GPU needed) and prints the attention output's relative error against the
float64 reference, beside the kernels' own query rounding (f16 with a power-of-two scale per head).
Softmax weights and accumulation stay in float64 here: only the query's rounding differs. Usage::

    PYTHONPATH=. python3 bench/fp8_query_split.py
"""

from __future__ import annotations

import torch

from kvstore.gpu import testing
from kvstore.gpu.codecs import fp8_dequantize_rows


def _f16_query(q: torch.Tensor) -> torch.Tensor:
    """The kernels' rounding: f16 with max |q| just under 2^14, per head."""
    scale = torch.exp2(torch.floor(torch.log2(16384.0 / q.abs().amax(-1, keepdim=True))))
    return (q * scale).to(torch.float16).double() / scale


def _e4m3_terms(n: int):
    """A query as the sum of ``n`` e4m3 terms, per head under one power-of-two scale."""

    def rounded(q: torch.Tensor) -> torch.Tensor:
        scale = torch.exp2(torch.floor(torch.log2(448.0 / q.abs().amax(-1, keepdim=True))))
        x, total = q * scale, torch.zeros_like(q)
        for _ in range(n):
            total = total + (x - total).to(torch.float8_e4m3fn).double()
        return total / scale

    return rounded


def _attend(case, rounding) -> torch.Tensor:
    a = int(case.seq_start[0])
    b = a + int(case.seq_len[0])
    lat = fp8_dequantize_rows(case.lc_codes[a:b], case.lc_scales[a:b]).double()
    rope = fp8_dequantize_rows(case.rc_codes[a:b], case.rc_scales[a:b]).double()
    q_lat, q_rope = rounding(case.q_lat.double()[0]), rounding(case.q_rope.double()[0])
    scores = (q_lat @ lat.T + q_rope @ rope.T) * case.softmax_scale
    return torch.softmax(scores, dim=-1) @ lat


def main() -> int:
    roundings = {"f16": _f16_query, **{f"e4m3 x{n}": _e4m3_terms(n) for n in (1, 2, 3)}}
    print(f"{'H':>4s} {'T':>8s} " + " ".join(f"{name:>9s}" for name in roundings))
    for heads, rows in ((64, 4097), (64, 32768), (128, 131072)):
        case = testing.make_case("fp8", [rows], heads, device="cpu", seed=3, nan_rate=0.0)
        ref = testing.reference(case)[0].double()
        errs = [float((_attend(case, r) - ref).norm() / ref.norm()) for r in roundings.values()]
        print(f"{heads:4d} {rows:8d} " + " ".join(f"{e:9.2e}" for e in errs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
