"""Quality of 16-bit tables: the demo's skip-gram (its corpus and model, HostEmbedding
modules) trained with float32 tables and with 16-bit ones (stochastic rounding on, the modules'
default, and off), for several seeds (each seed its own corpus draw, initialisation and
rounding stream; every dtype of a seed trains on the same corpus). Per run: the final loss
(the mean of the last three logged) and the nearest-neighbour precision@5 against the planted
clusters; per optimizer and dtype the mean over the seeds, and whether it lies within the
spread (min..max) of the float32 runs. Output: a table, --out/low_precision.json and .png.

    python3 bench/low_precision.py --seeds 0 1 2 --dtypes float32 bfloat16 \\
        --optimizers adam partial-rowwise-adam
"""

import argparse
import json
import os
import statistics
import time

import torch

from speedtorch_ops.demo.cli import parser as demo_parser
from speedtorch_ops.demo.corpus import CORPORA
from speedtorch_ops.demo.model import neighbour_precision
from speedtorch_ops.demo.train import DTYPES, OPTIMIZERS, train_engine


def one_run(demo_args, corpus, device, seed, optimizer, dtype, rounding) -> dict:
    a = demo_parser().parse_args(demo_args + [
        "--optimizer", optimizer, "--dtype", dtype,
        "--rounding", "nearest" if rounding is False else "stochastic"])
    a.engine, a.fused = "module", None
    torch.manual_seed(seed)
    r = train_engine(a, corpus, device)
    quality = neighbour_precision(r["table"].float().cpu(), corpus.cluster,
                                  corpus.judged_words())
    return {"seed": seed, "optimizer": optimizer, "dtype": dtype,
            "stochastic_rounding": rounding if dtype != "float32" else None,
            "final_loss": statistics.fmean(r["losses"][-3:]), "precision_at_5": float(quality),
            "steps_per_s": (a.steps - min(10, a.steps // 10)) / r["seconds"],
            "host_table_bytes": r["host_table_bytes"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES),
                   default=["float32", "bfloat16"])
    p.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS),
                   default=["adam", "partial-rowwise-adam"])
    p.add_argument("--no-rounding-runs", action="store_true",
                   help="skip the 16-bit runs with stochastic rounding off")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench/out")
    a, demo_args = p.parse_known_args()  # the rest go to the demo (--vocab, --steps, ...)
    demo_args = demo_args + ["--device", a.device]
    device = torch.device(a.device)
    base = demo_parser().parse_args(demo_args)
    runs = []
    for seed in a.seeds:
        corpus = CORPORA[base.corpus](base.vocab, base.cluster_size, base.tokens, seed=2019 + seed)
        for optimizer in a.optimizers:
            for dtype in a.dtypes:
                for rounding in ([None] if dtype == "float32" else
                                 [True] + ([] if a.no_rounding_runs else [False])):
                    runs.append(one_run(demo_args, corpus, device, seed, optimizer, dtype,
                                        rounding))
                    print(runs[-1], flush=True)
    summary = []
    for optimizer in a.optimizers:
        ref = [r for r in runs if r["optimizer"] == optimizer and r["dtype"] == "float32"]
        for dtype in a.dtypes:
            for rounding in dict.fromkeys(r["stochastic_rounding"] for r in runs
                                          if r["dtype"] == dtype):
                mine = [r for r in runs if r["optimizer"] == optimizer and r["dtype"] == dtype
                        and r["stochastic_rounding"] == rounding]
                row = {"optimizer": optimizer, "dtype": dtype, "stochastic_rounding": rounding,
                       "seeds": len(mine), "row_bytes": mine[0]["host_table_bytes"]
                       // (2 * base.vocab)}
                for key in ("final_loss", "precision_at_5", "steps_per_s"):
                    row[key] = statistics.fmean(r[key] for r in mine)
                for key in ("final_loss", "precision_at_5"):
                    lo, hi = min(r[key] for r in ref), max(r[key] for r in ref)
                    row[f"{key}_float32_spread"] = [lo, hi]
                    row[f"{key}_within_float32_spread"] = bool(lo <= row[key] <= hi)
                summary.append(row)
    print(f"{'optimizer':>22} {'dtype':>9} {'SR':>5} {'B/row':>6} {'loss':>7} {'f32 spread':>15} "
          f"{'p@5':>6} {'f32 spread':>13} {'steps/s':>8}")
    for r in summary:
        lo, hi = r["final_loss_float32_spread"]
        plo, phi = r["precision_at_5_float32_spread"]
        print(f"{r['optimizer']:>22} {r['dtype']:>9} {str(r['stochastic_rounding']):>5} "
              f"{r['row_bytes']:>6} {r['final_loss']:>7.4f} {lo:>7.4f}..{hi:<6.4f} "
              f"{r['precision_at_5']:>6.3f} {plo:>6.3f}..{phi:<5.3f} {r['steps_per_s']:>8.1f}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "torch": torch.__version__, "args": vars(a), "demo_args": demo_args,
              "runs": runs, "summary": summary}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "low_precision.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = sorted({(r["optimizer"], r["dtype"], str(r["stochastic_rounding"])) for r in runs})
    for ax, key in zip(axes, ("final_loss", "precision_at_5")):
        for x, (opt, dtype, sr) in enumerate(labels):
            ys = [r[key] for r in runs if (r["optimizer"], r["dtype"],
                                          str(r["stochastic_rounding"])) == (opt, dtype, sr)]
            ax.plot([x] * len(ys), ys, "o", color="C0" if dtype == "float32" else "C1")
        ax.set_xticks(range(len(labels)),
                      [f"{o}\n{d}" + ("" if s == "None" else f"\nSR {s}") for o, d, s in labels],
                      fontsize=7)
        ax.set_ylabel(key.replace("_", " "))
    fig.suptitle(f"demo skip-gram, {len(a.seeds)} seeds, {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "low_precision.png"), dpi=120)


if __name__ == "__main__":
    main()
