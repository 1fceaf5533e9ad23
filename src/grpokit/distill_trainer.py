"""DistillationTrainer: TRL 1.16's on-policy distillation (`trl.DistillationTrainer`) on grpokit's one training loop.

The student samples completions of the prompts (one per prompt, as TRL), nothing scores them, and the loss moves
the student's next-token distribution at every completion token toward a frozen teacher's: the generalized
Jensen–Shannon divergence of `loss.generalized_jsd` (beta 0 forward KL, 0.5 JSD, 1 reverse KL; Agarwal et al.
2024, arXiv 2306.13649), computed from both models' final hidden states and LM heads chunk by chunk
(`distillation.chunked_distillation_loss`), so neither model's [N, T, V] logits exist.

What is GRPO's and what is this file's: the loop, sampling engines, checkpoints, resume, callbacks and logging
are `GRPOTrainer`'s, run with `distillation_config.loop_config(args)` (num_generations = 1, no reference model);
`scores_completions = False` makes the experience maker skip rewards and advantages; this class loads the teacher
and replaces `compute_loss`. The loss of a micro-batch is its tokens' summed divergence over the token count of
the whole optimizer step's window (all processes), TRL's `num_items_in_batch`, so micro-batch losses add up to the
step's token mean.

Departures from TRL 1.16: `trainer.args` is the loop's GRPOConfig (the DistillationConfig given is
`trainer.distillation_args`); `teacher_model=None` falls back to `args.teacher_model_name_or_path` (TRL's own
script passes it explicitly); heads that transform their logits (soft-capping, logit scales), which TRL applies,
are refused; one process or DDP (not FSDP or DeepSpeed).
"""

from __future__ import annotations

import dataclasses

import torch

from .batch import TrainBatch
from .data import dataset_rows, is_iterable_dataset, named_eval_datasets
from .distillation import chunked_distillation_loss
from .distillation_config import DistillationConfig, loop_config
from .distributed import as_wrapper_forward, deepspeed_stage, unwrap_model
from .logprobs import causal_lm_of, completion_hidden_states, supports_chunked_head
from .logs import completion_metrics
from .models import default_output_dir
from .rollout import EVAL_SEED_OFFSET, rollout_seed
from .teacher import load_teacher
from .trainer import GRPOTrainer


def _row_major(hidden: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, width: int):
    """(hidden, rows, columns) of `completion_hidden_states` reordered row by row, column by column: the order of
    `mask.nonzero()`, the same for any model whichever path it took."""
    order = torch.argsort(rows * width + columns)
    return hidden[order], rows[order], columns[order]


class DistillationTrainer(GRPOTrainer):
    scores_completions = False
    progress_label = "Distillation"
    config_file = "distillation_config.json"

    def __init__(
        self,
        model,
        teacher_model=None,
        args: DistillationConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_engine=None,
    ):
        """TRL 1.16's arguments, in its order, plus grpokit's `rollout_engine` (see `GRPOTrainer`)."""
        if args is None:
            args = DistillationConfig(output_dir=default_output_dir(model, "Distillation"))
        if teacher_model is None:
            teacher_model = args.teacher_model_name_or_path
        if teacher_model is None:
            raise ValueError(
                "DistillationTrainer needs a teacher: pass teacher_model= (a model or a path / hub id) "
                "or set DistillationConfig.teacher_model_name_or_path."
            )
        self.distillation_args = args
        self.beta, self.temperature = args.beta, args.temperature  # TRL's attributes
        super().__init__(
            model,
            None,
            loop_config(args),
            train_dataset,
            eval_dataset,
            processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_engine=rollout_engine,
        )
        if deepspeed_stage(self.accelerator) is not None or self.accelerator.is_fsdp2:
            raise NotImplementedError(
                "DistillationTrainer runs on one process or under DDP: its loss reads the "
                "student's LM head weight whole, which FSDP and DeepSpeed shard or wrap."
            )
        self.teacher_model = load_teacher(
            teacher_model,
            args.teacher_model_init_kwargs,
            args.teacher_model_revision,
            args.trust_remote_code,
            self.accelerator.device,
            self.unwrapped_model,
            self.processing_class,
        )
        for role, lm in (("student", self.unwrapped_model), ("teacher", self.teacher_model)):
            if not supports_chunked_head(lm):
                raise ValueError(
                    f"The {role} ({type(causal_lm_of(lm)).__name__}) has an LM head the chunked "
                    f"divergence cannot compute (not a plain Linear over the decoder's last hidden "
                    f"state, or logits soft-capped / scaled): grpokit.logprobs.supports_chunked_head."
                )

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """TRL's hook: the distillation loss of one micro-batch (`inputs`, a `TrainBatch`) under `model`: the
        divergence summed over its loss-mask tokens (tool output and other inserted tokens are not the student's
        and take no part) over the window's token count (`num_items_in_batch` = (sequences, tokens, micro-batches)
        of the optimizer step's window; None: the current step's). Logs TRL's `entropy` (the student's, nats).
        `inputs` may also be a dict in TRL's layout (prompt_ids, prompt_mask, completion_ids, completion_mask): its
        loss is then TRL's, the divergence summed over `num_items_in_batch` tokens (a number; None: the mean over
        the batch's own tokens)."""
        if return_outputs:
            raise ValueError("The DistillationTrainer does not support returning outputs")
        if isinstance(inputs, dict):
            inputs = TrainBatch.from_trl_inputs(inputs, with_advantages=False)
            local_tokens = inputs.loss_mask.sum().item()
            num_items_in_batch = (0, local_tokens if num_items_in_batch is None else float(num_items_in_batch), 1)
        num_tokens = (num_items_in_batch or self._window_counts or (0, inputs.loss_mask.sum().item(), 1))[1]
        batch = inputs.trimmed()
        width = batch.completion_ids.shape[1]
        with self.accelerator.autocast(), torch.no_grad():
            teacher_hidden, _, _ = _row_major(
                *completion_hidden_states(
                    self.teacher_model, batch.input_ids, batch.input_mask, width, batch.multimodal
                ),
                width,
            )
        student = unwrap_model(self.accelerator, model)
        # Under DDP the student's part runs as the wrapper's forward, so that its backward reduces the gradients.
        loss, stats = as_wrapper_forward(
            model, student, self._student_loss, student, batch, teacher_hidden, max(num_tokens, 1)
        )
        self._step_stats.append(stats.as_dict())
        return loss

    def _student_loss(self, student, batch: TrainBatch, teacher_hidden: torch.Tensor, num_tokens: float):
        """The student's forward and the divergence from the teacher's hidden states (M rows, row-major)."""
        width = batch.completion_ids.shape[1]
        with self.accelerator.autocast():
            hidden, rows, columns = _row_major(
                *completion_hidden_states(student, batch.input_ids, batch.input_mask, width, batch.multimodal), width
            )
            student_head = causal_lm_of(student).get_output_embeddings()
            teacher_head = self.teacher_model.get_output_embeddings()
            return chunked_distillation_loss(
                hidden[None],
                student_head.weight,
                teacher_hidden[None].to(hidden.device),
                teacher_head.weight,
                batch.loss_mask[rows, columns][None],
                beta=self.beta,
                temperature=self.temperature,
                student_bias=student_head.bias,
                teacher_bias=teacher_head.bias,
                num_tokens=num_tokens,
            )

    def _model_card(
        self, method: str = "", final_keys: tuple[str, str] = ("loss", "eval_loss"), config: dict | None = None
    ) -> str:
        teacher = getattr(self.teacher_model.config, "name_or_path", "") or type(self.teacher_model).__name__
        return super()._model_card(
            f"on-policy distillation against the teacher **{teacher}**",
            final_keys,
            dataclasses.asdict(self.distillation_args),
        )

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """TRL's evaluation: the student samples one completion per prompt of eval_dataset (default: the
        trainer's; fixed seeds, so the same weights give the same completions), `eval_loss` is their token mean of
        the divergence from the teacher, with TRL's `eval_entropy` and `eval_completions/...`. Named sets (a dict)
        are evaluated one by one, prefixed `eval_<name>`."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("No eval_dataset: pass one to DistillationTrainer(eval_dataset=...) or to evaluate().")
        args, metrics, training = self.args, {}, self.model.training
        self.model.eval()
        for name, one in named_eval_datasets(dataset).items():
            prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
            rows_of = dataset_rows(one) if is_iterable_dataset(one) else one
            divergence, entropy, tokens, lengths, truncated = 0.0, 0.0, 0.0, [], []
            size = args.per_device_eval_batch_size
            for index, start in enumerate(range(0, len(rows_of), size)):
                rows = [rows_of[i] for i in range(start, min(start + size, len(rows_of)))]
                seed = rollout_seed(args.seed + EVAL_SEED_OFFSET, index, 0)
                generation, _ = self.experience.sample_and_score(rows, [1] * len(rows), seed, self.state)
                batch = TrainBatch.from_rollout(generation.rollout, torch.zeros(len(rows)))
                count = batch.loss_mask.sum().item()
                # num_tokens 1: the divergence summed over the batch's tokens, divided once by all of them below
                divergence += self.compute_loss(self.model, batch, num_items_in_batch=(len(rows), 1.0, 1)).item()
                entropy += self._step_stats.pop()["entropy"] * count
                tokens += count
                lengths.append(generation.model_lengths.float().cpu())
                truncated.append(generation.rollout.is_truncated.float().cpu())
            metrics[f"{prefix}_loss"] = divergence / max(tokens, 1.0)
            metrics[f"{prefix}_entropy"] = entropy / max(tokens, 1.0)
            found = completion_metrics(torch.cat(lengths), torch.cat(truncated))
            metrics.update({f"{prefix}_{key}": value for key, value in found.items()})
        self.model.train(training)
        self.callback_handler("on_evaluate", self.args, self.state, metrics=metrics)
        return metrics
