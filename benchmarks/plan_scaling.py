"""Per-rank memory and predicted step time of GPT-2 XL and a 70B model from 8 to 4,096 ranks (the plan).

Run: ``python benchmarks/plan_scaling.py [--ranks 8,64,512,4096] [--json benchmarks/results/plan-scaling.json]
     [--svg docs/img/plan_scaling.svg]``

Every row is :func:`lightning_zero.plan.plan` (the engine on meta tensors in a fake process group of
that size; bf16-mixed, AdamW, the strategy's defaults, micro-batch 1) timed on an H100 of the table
(NVLink within a node of 8, InfiniBand NDR400 beyond). "ZeRO formula" is the paper's model states
(stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N); the plan's model states differ by the
padding and the parameters stage 3 keeps whole. The plot (SVG, no plotting library needed) shows
the planned peak per rank against the ranks, log-log.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

#: Hugging Face configs: GPT-2 XL (1.56B) and a Llama-3-70B shape (70.6B, untied embeddings)
MODELS = {
    "GPT-2 XL": {
        "model_type": "gpt2",
        "n_layer": 48,
        "n_embd": 1600,
        "n_head": 25,
        "vocab_size": 50257,
        "n_positions": 1024,
    },
    "70B": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
}
STAGES = {"GPT-2 XL": (1, 2, 3), "70B": (3,)}
FORMULA = {1: lambda p, n: 4 * p + 12 * p / n, 2: lambda p, n: 2 * p + 14 * p / n, 3: lambda p, n: 16 * p / n}


def _svg(series: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """A log-log line plot of planned peak MiB per rank against ranks."""
    import math

    width, height, left, bottom, top, right = 640, 400, 70, 50, 20, 170
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points]
    x0, x1 = math.log10(min(xs)), math.log10(max(xs))
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))

    def px(x: float, y: float) -> tuple[float, float]:
        u = left + (math.log10(x) - x0) / max(x1 - x0, 1e-9) * (width - left - right)
        v = height - bottom - (math.log10(y) - y0) / max(y1 - y0, 1e-9) * (height - bottom - top)
        return u, v

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">'
    ]
    out.append(f'<rect width="{width}" height="{height}" fill="white"/>')
    for x in sorted(set(xs)):
        u, _ = px(x, 10**y0)
        out.append(f'<line x1="{u:.1f}" y1="{top}" x2="{u:.1f}" y2="{height - bottom}" stroke="#ddd"/>')
        out.append(f'<text x="{u:.1f}" y="{height - bottom + 15}" text-anchor="middle">{x:,}</text>')
    for e in range(y0, y1 + 1):
        _, v = px(10**x0, 10**e)
        out.append(f'<line x1="{left}" y1="{v:.1f}" x2="{width - right}" y2="{v:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 5}" y="{v + 4:.1f}" text-anchor="end">{10**e:,} MiB</text>')
    out.append(
        f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">data-parallel ranks</text>'
    )
    for i, (name, points) in enumerate(series.items()):
        color = colors[i % len(colors)]
        path_d = " ".join(
            f"{'M' if j == 0 else 'L'}{u:.1f},{v:.1f}" for j, (u, v) in enumerate(px(x, y) for x, y in points)
        )
        out.append(f'<path d="{path_d}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{width - right + 10}" y="{top + 15 + 16 * i}" fill="{color}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,64,512,4096")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--svg", default=None)
    args = parser.parse_args()
    from lightning_zero.config import ZeroConfig
    from lightning_zero.plan import plan
    from lightning_zero.plan.machine import known

    rows, series = [], {}
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            config = Path(tmp) / f"{name.replace(' ', '_')}.json"
            config.write_text(json.dumps(MODELS[name]))
            for stage in STAGES[name]:
                points = []
                for n in (int(x) for x in args.ranks.split(",")):
                    start = time.process_time()
                    p = plan(str(config), n, zero=ZeroConfig(stage=stage), seq_len=args.seq_len)
                    seconds = time.process_time() - start
                    machine = known("H100", "nvlink4" if n <= 8 else "ib-ndr400")
                    t = p.step_time(machine)
                    states = (
                        p.total("device") - p.memory["device"]["communication_buckets"] - p.memory["device"]["buffers"]
                    )
                    row = [
                        name,
                        stage,
                        f"{n:,}",
                        f"{states / mib:,.1f}",
                        f"{FORMULA[stage](p.numel, n) / mib:,.1f}",
                        f"{p.memory['device']['communication_buckets'] / mib:,.1f}",
                        f"{p.transient_peak / mib:,.1f}",
                        f"{p.peak / mib:,.1f}",
                        f"{t.seconds * 1e3:,.1f}",
                        f"{t.exposed_communication * 1e3:,.1f}",
                        f"{seconds:.1f}",
                    ]
                    rows.append(row)
                    points.append((n, p.peak / mib))
                    print(" | ".join(str(c) for c in row), flush=True)
                series[f"{name} stage {stage}"] = points
    headers = [
        "model",
        "stage",
        "ranks",
        "model states MiB",
        "ZeRO formula MiB",
        "pool MiB",
        "step transient MiB",
        "planned peak MiB",
        "H100 step ms",
        "exposed comm ms",
        "plan CPU s",
    ]
    print(common.format_table(headers, rows))
    if args.svg:
        _svg(series, Path(args.svg))
    common.write_json(
        args.json,
        {
            "machine": {**common.machine(), "ranks": "none: every rank is planned in one process"},
            "title": "plan_scaling.py: GPT-2 XL and a 70B model from 8 to 4,096 ranks (planned)",
            "topic": "memory",
            "command": ("python benchmarks/plan_scaling.py " + " ".join(sys.argv[1:])).strip(),
            "headers": headers,
            "rows": rows,
            "notes": [
                f"Sequence length {args.seq_len}, micro-batch 1, bf16-mixed AdamW; H100 of the plan's table "
                "(NVLink for 8 ranks, InfiniBand NDR400 beyond, efficiency 0.5); 'plan CPU s' is the CPU time "
                "of one plan on the 2-core development machine."
            ],
        },
    )


if __name__ == "__main__":
    main()
