"""The charts a finetune run logs beside its metrics (matplotlib, optional)."""

from __future__ import annotations

import mlflow

from draftline import tracking
from draftline.console import say


def log_accuracy_chart(run_id: str, ttt_steps: int) -> None:
    """Per-position full/conditional accuracy at the end of training (val/ when there is validation); skipped,
    saying so, where matplotlib is not installed (a chart never fails a finished run)."""
    try:
        import matplotlib  # noqa: PLC0415 (optional: matplotlib)
    except ImportError:
        say("per_position_accuracy.png not drawn: matplotlib is not installed")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: matplotlib)

    metrics = tracking.client().get_run(run_id).data.metrics
    split = "val" if "val/full_acc_0" in metrics else "train"
    ks = list(range(ttt_steps))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    width = 0.38
    ax.bar([k - width / 2 for k in ks], [metrics.get(f"{split}/full_acc_{k}", 0.0) for k in ks], width,
           label="full_acc_k")
    ax.bar([k + width / 2 for k in ks], [metrics.get(f"{split}/cond_acc_{k}", 0.0) for k in ks], width,
           label="cond_acc_k")
    ax.set(xlabel="draft position k", ylabel="accuracy", ylim=(0, 1), xticks=ks,
           title=f"{split}: acceptance length {metrics.get(f'{split}/acceptance_length', float('nan')):.2f}")
    ax.legend()
    fig.tight_layout()
    mlflow.log_figure(fig, "per_position_accuracy.png")
    plt.close(fig)
