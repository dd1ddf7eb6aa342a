"""Plot serving-bench results: mean ITL and throughput per mode, as ratios to native vLLM.

    python -m bench.plot bench/results/A.json [B.json ...] --out bench/results/plot.png

Needs matplotlib (not a dependency of xmix-lens: `pip install matplotlib`). Bars are medians over
the repeats; whiskers span the repeats' min and max, each divided by the native median.
"""
import argparse
import json


def main(argv=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    workloads = {}
    for path in args.results:
        workloads.update(json.load(open(path))["workloads"])
    metrics = [("mean_itl_ms", "mean ITL / native"), ("throughput_tok_s", "throughput / native")]
    fig, axes = plt.subplots(len(metrics), len(workloads), figsize=(4.2 * len(workloads), 6.5), squeeze=False)
    for column, (name, workload) in enumerate(workloads.items()):
        modes = list(workload["summary"])
        for row, (metric, label) in enumerate(metrics):
            ax = axes[row][column]
            base = workload["summary"]["native"][metric]["median"]
            stats = [workload["summary"][m][metric] for m in modes]
            ratios = [s["median"] / base for s in stats]
            errors = [[r - s["min"] / base for r, s in zip(ratios, stats)],
                      [s["max"] / base - r for r, s in zip(ratios, stats)]]
            ax.bar(range(len(modes)), ratios, yerr=errors, capsize=3, color="tab:blue")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(modes)), modes, rotation=45, ha="right", fontsize=8)
            ax.set_ylabel(label, fontsize=9)
            if row == 0:
                ax.set_title(f"{name}: {workload['requests']} x {workload['prompt_len']} in / "
                             f"{workload['output_len']} out", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
