"""What the trainer hands every reward function besides the batch's columns (TRL 1.16's contract):
`trainer_state` (the TrainerState, for rewards that change with training progress), `log_metric(name, value)`
(a scalar logged beside the built-in metrics, averaged over the logging window and over processes) and
`log_extra(column, values)` (one value per completion, shown as a column of the completions log)."""

from __future__ import annotations

from collections import defaultdict

CONTEXT_ARGUMENTS = ("trainer_state", "log_metric", "log_extra", "environments")


class RewardLogs:
    def __init__(self):
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra[column].extend(list(values))

    def flush_metrics(self, accelerator) -> dict[str, float]:
        """Each metric's mean over the values logged since the last flush, on every process together (a
        collective: every process calls it at the same point, whatever it logged)."""
        import torch

        from ..distributed import gather_objects

        names = sorted(self.metrics)
        if accelerator.num_processes > 1:  # sorted, so that every process reduces the same names in one order
            names = sorted({name for names_of_one in gather_objects(accelerator, [names]) for name in names_of_one})
        totals = torch.tensor(
            [[sum(self.metrics.get(n, [])), len(self.metrics.get(n, []))] for n in names],
            dtype=torch.float64,
            device=accelerator.device,
        ).reshape(-1, 2)
        if accelerator.num_processes > 1 and names:
            totals = accelerator.reduce(totals, "sum")
        self.metrics.clear()
        return {name: (total / count) for name, (total, count) in zip(names, totals.tolist()) if count}

    def flush_extra(self) -> dict[str, list]:
        extra, self.extra = dict(self.extra), defaultdict(list)
        return extra
