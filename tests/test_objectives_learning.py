"""Every new objective trains: a TRL-style script with each loss type, advantage estimator and GDPO's
normalize_then_sum learns the letter task by the criterion of tests/test_trainer.py::test_trl_style_script_learns.

Slow (about 20 s each on two cores, minutes together): `pytest --runslow tests/test_objectives_learning.py`."""

import pytest
from letters import LETTERS, letter_dataset, repeat_letter

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.testing import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", chars=LETTERS + ":", hidden_size=64))


def is_a_letter(completions, **kwargs):
    return [float(c[:1] in LETTERS and len(c) > 0) for c in completions]


CASES = {
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),  # ScaleRL's cap; TRL caps the weight at epsilon_high itself
    "sapo": dict(loss_type="sapo", max_steps=120, learning_rate=5e-3),  # at 1e-2 its entropy collapses early
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "normalize_then_sum": dict(multi_objective_aggregation="normalize_then_sum", rewards=[repeat_letter, is_a_letter]),
    "rloo": dict(advantage_estimator="rloo", scale_rewards="none"),
    "reinforce_pp_baseline": dict(advantage_estimator="reinforce_pp_baseline", scale_rewards="batch"),
    "off_policy_mask": dict(off_policy_mask_threshold=0.5, num_iterations=2, beta=0.04),
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=5.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_objective_learns_the_letter_task(model_dir, tmp_path, case):
    values = {"max_steps": 80, "learning_rate": 1e-2, **CASES[case]}
    rewards = values.pop("rewards", [repeat_letter])
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=2,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="no",
        disable_tqdm=True,
        **values,
    )
    trainer = GRPOTrainer(model=model_dir, reward_funcs=rewards, args=args, train_dataset=letter_dataset())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    letter = [entry["rewards/repeat_letter/mean"] for entry in logs]
    assert letter[0] < 0.25, letter
    assert sum(letter[-8:]) / 8 >= 0.45, letter
    if case == "adaptive_entropy":  # entropy stays below the target: the bonus applies, its coefficient grows
        coefs = [entry["entropy_coef"] for entry in logs]
        assert coefs[-1] > coefs[0] >= 0.01, coefs
