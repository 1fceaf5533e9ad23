"""verifiers 0.4's v1 environments (grpokit.integrations.verifiers_v1): a `verifiers.v1.Env` over a local taskset
(tests/verifiers_v1_lookup.py) runs its episodes against grpokit's policy endpoint through verifiers' own
TrainClient, and trains; the episodes' rewards are the logged rewards. Needs verifiers 0.4, in an environment of its
own (`-m verifiers_v1`; .ci/run builds it)."""

import pytest
from agents_helpers import key_of, tiny_agent_model, tool_call_script

from grpokit import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.verifiers_v1


def lookup_env():
    import verifiers.v1 as vf
    from verifiers.v1.runtimes import SubprocessConfig

    config = vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id="verifiers_v1_lookup"), agent=vf.AgentConfig(runtime=SubprocessConfig())
    )
    return vf.SingleAgentEnv(config)


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=2,
        max_steps=1,
        max_completion_length=48,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
    )
    return GRPOConfig(**{**values, **overrides})


def test_a_verifiers_v1_env_trains_through_the_endpoint_with_its_episode_rewards(tmp_path):
    import verifiers_v1_lookup

    from grpokit.integrations.verifiers_v1 import VerifiersV1Environment

    env = lookup_env()
    model, tokenizer = tiny_agent_model()
    # A scripted policy: the value for k1 and k2, a wrong answer for the others (rewards that differ).
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{verifiers_v1_lookup.TABLE[key_of(user)]}<|im_end|>" if key_of(user) in ("k1", "k2") else "v??<|im_end|>"
        ),
    )
    trainer = GRPOTrainer(
        model=model, args=config(tmp_path), processing_class=tokenizer, environment=env, rollout_engine=engine
    )
    assert isinstance(trainer.agents.play.__self__, VerifiersV1Environment)
    verifiers_v1_lookup.RETURNED.clear()
    trainer.train()
    log = trainer.state.log_history[0]
    assert len(verifiers_v1_lookup.RETURNED) == 8  # 4 tasks, 2 episodes each
    assert sorted(set(verifiers_v1_lookup.RETURNED)) == [1.0 - 6 / 300, 2.0 - 4 / 300]  # two short answers each
    assert log["reward"] == pytest.approx(sum(verifiers_v1_lookup.RETURNED) / 8)
    assert log["rewards/episode_reward/mean"] == pytest.approx(sum(verifiers_v1_lookup.RETURNED) / 8)
    # The harness's two turns through verifiers' TrainClient: one sequence per episode, no prefix break.
    assert log["endpoint/calls_per_rollout"] == 2.0 and log["endpoint/prefix_break_frequency"] == 0.0
    assert log["endpoint/error_frequency"] == 0.0 and log["endpoint/timeout_frequency"] == 0.0


@pytest.mark.slow
def test_a_tiny_model_improves_on_a_verifiers_v1_env(tmp_path):
    """The in-process engine samples a random tiny model's turns through verifiers' TrainClient; GRPO on the
    episodes' rewards (the brevity term: the values are out of a random model's reach) makes the answers short.
    Measured on CPU: 0.48 over the first 8 steps -> 1.00 over the last 8 (empty answers), about 100 s."""
    model, tokenizer = tiny_agent_model()
    args = config(
        tmp_path,
        max_steps=60,
        per_device_train_batch_size=16,
        num_generations=4,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        max_completion_length=32,
    )
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, environment=lookup_env())
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    print(f"reward over the first 8 steps {first:.3f}, over the last 8 {last:.3f}")
    assert last > first + 0.2
