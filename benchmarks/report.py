"""The table, the JSON and the plots of ``run.py``, from the per-rank results of every configuration."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import common
from measure import formula_bytes

#: each system's counterpart in DeepSpeed (the "same stage") and, for offload, in our non-offloaded runs
DEEPSPEED_TWIN = {
    "ddp": "ds0",
    "zero_redundancy": "ds1",
    "zero1": "ds1",
    "zero2": "ds2",
    "zero3": "ds3",
    "fsdp2": "ds3",
    "fsdp2_no_reshard": "ds3",
    "zero2_offload": "ds2_offload",
    "zero3_offload": "ds3_offload",
}
NO_OFFLOAD = {"zero2_offload": "zero2", "zero3_offload": "zero3", "ds2_offload": "ds2", "ds3_offload": "ds3"}
#: step-time targets (ratio to DDP; offload: ratio to the same stage without offload)
TIME_TARGET = {"zero1": 1.05, "zero2": 1.05, "zero3": 1.15, "zero2_offload": 0.99 * 1.05, "zero3_offload": 1.02 * 1.05}
BYTES_TARGET = 1.05
#: peak-RSS targets (ratio to DDP's peak RSS growth per rank, in the same run)
RSS_TARGET = {"zero2": 0.75, "zero3": 0.75}
MIB = 2**20


def summarize(
    configs: list[tuple[str, str, str]], per_rank: list[dict], warmup: int, n: int, peaks: dict | None = None
) -> list[dict]:
    """One record per (workload, precision, system): median step (rank 0), bytes (largest rank) and
    peak RSS growth per rank and what ours account for (``peaks``: ``run.rss_pass``)."""
    records = []
    for workload, precision, system in configs:
        key = f"{workload} {precision} {system}"
        runs = per_rank[0][key]
        errors = [r["error"] for r in runs if "error" in r]
        steps = [s for r in runs if "error" not in r for s in r["steps"]]
        record: dict[str, Any] = {
            "workload": workload,
            "precision": precision,
            "system": system,
            "psi": per_rank[0]["psi"][workload],
            "errors": errors,
        }
        if steps:
            # the last successful run of each rank (a rank may have failed where rank 0 did not)
            ok = [good[-1] for rank in per_rank if (good := [r for r in rank[key] if "error" not in r])]
            largest = max(ok, key=lambda r: r["bytes"])
            record.update(
                median_s=statistics.median(steps),
                min_s=min(steps),
                max_s=max(steps),
                steps_s=steps,
                bytes=largest["bytes"],
                split=_split(largest["split"]),
            )
        record["formula"] = formula_bytes(system, precision, record["psi"], n)
        entry = (peaks or {}).get(key) or {}
        peak = entry.get("peak")
        if isinstance(peak, int):
            record["peak_rss"] = peak
            if entry.get("accounted") and entry.get("resident"):
                # memory_breakdown() + activations + allocator slack + library pages over the resident
                # set at the same moment, the end of a forward (within 10%)
                record["rss_accounted"] = entry["accounted"] / entry["resident"]
        elif peak is not None:
            record["errors"].append("peak RSS run: " + peak)
        records.append(record)
    _ratios(records)
    return records


def _split(split: dict | None) -> dict | None:
    """ZeRO's ``memory_breakdown`` as model-state bytes on the device and on the host."""
    if split is None:
        return None
    states = ("parameters", "gradients", "master_weights", "optimizer_states")
    return {where: sum(split[where][k] for k in states) for where in ("device", "host")} | {"categories": split}


def _ratios(records: list[dict]) -> None:
    index = {(r["workload"], r["precision"], r["system"]): r for r in records}
    for r in records:
        if "median_s" not in r:
            continue
        base = r["system"].split("@")[0]  # a variant with options (systems.variant): its system's peers
        peers = {
            name: index.get((r["workload"], r["precision"], name))
            for name in ("ddp", DEEPSPEED_TWIN.get(base, r["system"]), NO_OFFLOAD.get(base, ""))
        }
        for label, name in (
            ("ddp", "ddp"),
            ("ds", DEEPSPEED_TWIN.get(base, r["system"])),
            ("no_offload", NO_OFFLOAD.get(base, "")),
        ):
            peer = peers.get(name)
            if peer and "median_s" in peer:
                r[f"time_vs_{label}"] = r["median_s"] / peer["median_s"]
                r[f"bytes_vs_{label}"] = r["bytes"] / peer["bytes"]
        r["bytes_vs_formula"] = r["bytes"] / sum(r["formula"][k] for k in ("device", "host"))
        ddp = peers.get("ddp")
        if "peak_rss" in r:
            r["rss_vs_formula"] = r["peak_rss"] / sum(r["formula"][k] for k in ("device", "host"))
            if ddp and "peak_rss" in ddp:
                r["rss_vs_ddp"] = r["peak_rss"] / ddp["peak_rss"]
        r["verdict"] = _verdict(r)


def _verdict(r: dict) -> str:
    system = r["system"]
    if system not in TIME_TARGET:
        return ""
    base = "time_vs_no_offload" if system in NO_OFFLOAD else "time_vs_ddp"
    parts = []
    if base in r:
        parts.append("ok" if r[base] <= TIME_TARGET[system] else f"time>{TIME_TARGET[system]:.2f}")
    parts.append("ok" if r["bytes_vs_formula"] <= BYTES_TARGET else f"bytes>{BYTES_TARGET}")
    if system in RSS_TARGET and "rss_vs_ddp" in r:
        parts.append("ok" if r["rss_vs_ddp"] <= RSS_TARGET[system] else f"rss>{RSS_TARGET[system]:.2f}xDDP")
    return "ok" if set(parts) == {"ok"} else " ".join(p for p in parts if p != "ok")


def _x(r: dict, key: str) -> str:
    return f"{r[key]:.2f}" if key in r else "-"


def _mib(r: dict) -> str:
    if r.get("split") and r["split"]["host"]:
        return f"{r['bytes'] / MIB:.0f} (dev {r['split']['device'] / MIB:.0f} + host {r['split']['host'] / MIB:.0f})"
    return f"{r['bytes'] / MIB:.0f}"


def _formula(r: dict) -> str:
    f = r["formula"]
    if f["host"]:
        return f"{(f['device'] + f['host']) / MIB:.0f} (dev {f['device'] / MIB:.0f} + host {f['host'] / MIB:.0f})"
    return f"{f['device'] / MIB:.0f}"


def table(records: list[dict]) -> str:
    """The Markdown table: step time and bytes per rank, with their ratios, one row per configuration."""
    headers = [
        "workload",
        "system",
        "precision",
        "step ms (median)",
        "x DDP",
        "x DS same stage",
        "x no offload",
        "MiB/rank",
        "x DDP",
        "x DS",
        "formula MiB",
        "x formula",
        "peak RSS MiB/rank",
        "x DDP",
        "x formula",
        "accounted",
        "target",
    ]
    rows = []
    for r in records:
        if "median_s" not in r:
            rows.append(
                [
                    r["workload"],
                    r["system"],
                    r["precision"],
                    "failed: " + r["errors"][0].strip().splitlines()[-1][:60],
                    *["-"] * 13,
                ]
            )
            continue
        rows.append(
            [
                r["workload"],
                r["system"],
                r["precision"],
                f"{r['median_s'] * 1e3:.0f}",
                _x(r, "time_vs_ddp"),
                _x(r, "time_vs_ds"),
                _x(r, "time_vs_no_offload"),
                _mib(r),
                _x(r, "bytes_vs_ddp"),
                _x(r, "bytes_vs_ds"),
                _formula(r),
                _x(r, "bytes_vs_formula"),
                f"{r['peak_rss'] / MIB:.0f}" if "peak_rss" in r else "-",
                _x(r, "rss_vs_ddp"),
                _x(r, "rss_vs_formula"),
                _x(r, "rss_accounted"),
                r["verdict"],
            ]
        )
    return common.format_table(headers, rows)


def write(out: Path, payload: dict) -> Path:
    """``out/results.json`` with the machine description."""
    path = out / "results.json"
    path.write_text(json.dumps({"machine": common.machine(), **payload}, indent=2, default=str) + "\n")
    return path


def plots(out: Path, records: list[dict], cpu_adam: list[dict] | None) -> list[Path]:
    """PNG plots: step time by system, bytes vs formula, CPU Adam GB/s vs bandwidth. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e .[bench])")
        return []
    done = [r for r in records if "median_s" in r]
    labels = [f"{r['system']}\n{r['workload']} {r['precision']}" for r in done]
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, len(done) * 0.7), 4))
    ax.bar(
        range(len(done)),
        [r["median_s"] * 1e3 for r in done],
        yerr=[[(r["median_s"] - r["min_s"]) * 1e3 for r in done], [(r["max_s"] - r["median_s"]) * 1e3 for r in done]],
        color=[_colour(r["system"]) for r in done],
        capsize=2,
    )
    ax.set_xticks(range(len(done)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("step time, ms (median; bar = min-max)")
    ax.set_title("Step time by system (2 CPU/gloo ranks)")
    paths.append(_save(fig, out / "step_time.png"))

    fig, ax = plt.subplots(figsize=(max(6, len(done) * 0.7), 4))
    xs = range(len(done))
    ax.bar([x - 0.27 for x in xs], [r["bytes"] / MIB for r in done], width=0.27, label="live tensors")
    ax.bar(
        list(xs),
        [(r["formula"]["device"] + r["formula"]["host"]) / MIB for r in done],
        width=0.27,
        label="ZeRO formula",
    )
    ax.bar([x + 0.27 for x in xs], [r.get("peak_rss", 0) / MIB for r in done], width=0.27, label="peak RSS growth (OS)")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("MiB per rank")
    ax.legend()
    ax.set_title("Bytes per rank: live tensors, the ZeRO formula, peak RSS")
    paths.append(_save(fig, out / "bytes_vs_formula.png"))

    if cpu_adam:
        fig, ax = plt.subplots(figsize=(7, 4))
        rows = [r for r in cpu_adam if r["what"] != "memory bandwidth (a += b)"]
        ax.barh([f"{r['what']} ({r['size']})" for r in rows], [r["gbs"] for r in rows])
        for size in sorted({r["size"] for r in cpu_adam}):
            bw = next(r["gbs"] for r in cpu_adam if r["size"] == size and r["what"].startswith("memory"))
            ax.axvline(bw, linestyle="--", color="k")
            ax.text(bw, 0, f" bandwidth {bw:.1f} GB/s ({size})", rotation=90, va="bottom", fontsize=7)
        ax.set_xlabel("GB/s (28 bytes per parameter for a step; 30 for the fused pass)")
        ax.set_title("CPU Adam throughput vs measured memory bandwidth")
        ax.tick_params(axis="y", labelsize=7)
        paths.append(_save(fig, out / "cpu_adam.png"))
    return paths


def _colour(system: str) -> str:
    if system.startswith("ds"):
        return "tab:orange"
    if system.startswith("zero") and system != "zero_redundancy":
        return "tab:blue"
    return "tab:gray"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
