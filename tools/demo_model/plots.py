"""The demo model's two figures: the loss curve and the per-layer expert hit distribution.

    pip install matplotlib   # a development tool only: no runtime or test dependency
    python -m tools.demo_model.plots [--records tools/demo_model] [--out tools/demo_model]

Reads loss.csv and expert_hits.json (as pack.py unpack installs them) and
writes loss.png and expert_hits.png.
"""

import argparse
import csv
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def plot_loss(loss_csv: pathlib.Path, out_png: pathlib.Path) -> None:
    """Train and validation cross-entropy against tokens seen, and the learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(loss_csv.open()))
    tokens = [int(r["tokens"]) / 1e6 for r in rows]
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1))
    ax.plot(tokens, [float(r["train_loss"]) for r in rows], label="train (mean of the last 10 steps)", lw=1)
    val = [(t, float(r["val_loss"])) for t, r in zip(tokens, rows) if r["val_loss"]]
    ax.plot(*zip(*val), "o-", label="validation (1% of the records, held out)", ms=3)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=min(8.0, max(float(r["train_loss"]) for r in rows)))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("moemesh demo model: loss")
    ax_lr.plot(tokens, [float(r["lr"]) for r in rows], color="gray", lw=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("training tokens (millions)")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def plot_hits(hits_json: pathlib.Path, out_png: pathlib.Path) -> None:
    """One bar chart per layer: each expert's share of routed slots, sorted, against uniform."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hits = json.loads(hits_json.read_text())
    layers = hits["layers"]
    cols = 3
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(10, 2.6 * rows), sharey=True, squeeze=False)
    for ax, layer in zip(axes.flat, layers):
        total = sum(layer["hits"])
        shares = sorted((h / total for h in layer["hits"]), reverse=True)
        ax.bar(range(len(shares)), shares, color="tab:blue")
        ax.axhline(1 / len(shares), color="red", lw=1, ls="--")
        ax.set_title(f"layer {layer['layer']}: max/mean {layer['max_over_mean']:.2f}", fontsize=9)
        ax.set_xticks([])
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("share of slots")
    fig.suptitle(f"expert hits over the fixed prompt set ({hits['num_tokens']} tokens, top-{hits['top_k']}); "
                 "experts sorted by hits, dashed: uniform", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=pathlib.Path, default=HERE, help="where loss.csv and expert_hits.json are")
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
    args = parser.parse_args(argv)
    plot_loss(args.records / "loss.csv", args.out / "loss.png")
    plot_hits(args.records / "expert_hits.json", args.out / "expert_hits.png")
    print(f"wrote {args.out / 'loss.png'} and {args.out / 'expert_hits.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
