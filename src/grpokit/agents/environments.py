"""Environments (TRL 1.16's `environment_factory`): objects whose public methods are the model's tools.

`environment_factory` is a callable returning an environment, or a dict name → factory (each dataset row names its
environment in an `environment` column). An environment has `reset(**row)`, which returns the first observation
(appended to the prompt's last user message) or None, and, optionally, `get_reward()`, which makes it a reward
source (one reward function per environment class, named after it, weight 1). Instances are pooled per process:
built once, reset for every rollout; a batch that needs more concurrent instances of one environment than exist
builds more.

An instance whose tool call timed out is retired (issue 39): the abandoned call may still run and write into it, so
it is never reset for another rollout (the pool builds a fresh one from the factory when it needs one), and its own
rollout is not scored by it (its get_reward gives None, "does not apply": what the instance holds depends on when
the abandoned call finishes, not on the transcript the model saw).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

from .tools import check_tools

ENVIRONMENT_COLUMN = "environment"


def public_methods(environment) -> list[Callable]:
    """The environment's tools: its public methods other than reset and get_reward (listed on the class, so that
    properties are not evaluated)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    ]


class EnvironmentPool:
    def __init__(self, environment_factory):
        self.routed = isinstance(environment_factory, dict)
        self.factories: dict = environment_factory if self.routed else {None: environment_factory}
        if not self.factories:
            raise ValueError("environment_factory is an empty dict: map at least one environment name to a factory.")
        self.pool: dict = {}
        self.lent: set[int] = set()  # ids of the instances whose rollouts are not scored yet
        self.lock = threading.Lock()
        self.retired: dict[int, object] = {}  # id -> instance (held, so that the id stays its own) until scored
        self.tools: dict = {}  # environment name -> its tools, the probe instance's methods (TRL's `_env_tools`)
        self.reward_types: list[type] = []  # classes that own a reward (get_reward), one reward function each
        for name, factory in self.factories.items():
            if not callable(factory):
                raise TypeError(
                    f"environment_factory[{name!r}] is {factory!r}, not a callable returning an environment."
                )
            instance = factory()
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(
                    f"Each environment instance returned by `environment_factory` must define a callable "
                    f"`reset`. The environment {type(instance).__name__} (from environment_factory"
                    f"{'' if name is None else f'[{name!r}]'}) has none: add reset(**row), which returns "
                    f"the first observation, or None."
                )
            methods = public_methods(instance)
            check_tools(methods, f"environment {type(instance).__name__}")
            self.tools[name] = methods
            self.pool[name] = [instance]
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_types:
                self.reward_types.append(type(instance))

    def names_of(self, rows: list[dict]) -> list:
        if not self.routed:
            return [None] * len(rows)
        names = []
        for row in rows:
            if ENVIRONMENT_COLUMN not in row:
                raise ValueError(
                    f"environment_factory is a dict of environments, so every row needs an "
                    f"'{ENVIRONMENT_COLUMN}' column naming one of {list(self.factories)}; this row has "
                    f"columns {sorted(row)}."
                )
            if row[ENVIRONMENT_COLUMN] not in self.factories:
                raise ValueError(
                    f"Example has `{ENVIRONMENT_COLUMN}={row[ENVIRONMENT_COLUMN]!r}`, which is not among "
                    f"the environments passed to `environment_factory`. Expected one of: "
                    f"{list(self.factories)}."
                )
            names.append(row[ENVIRONMENT_COLUMN])
        return names

    def take(self, names: list) -> list:
        """One instance per row, lent until `give_back`: the pooled ones that are not lent, in pool order, and
        more built only when none is free. Rollouts of several rows at once (a streaming producer) get disjoint
        instances."""
        out = []
        with self.lock:
            for name in names:
                pool = self.pool[name]
                free = next((e for e in pool if id(e) not in self.lent), None)
                if free is None:
                    free = self.factories[name]()
                    pool.append(free)
                self.lent.add(id(free))
                out.append(free)
        return out

    def give_back(self, environments: list) -> None:
        """The rollouts of `environments` are scored, or never will be (dropped, abandoned, failed): they may be lent
        again (retired ones never are, and are let go)."""
        with self.lock:
            for environment in environments:
                self.lent.discard(id(environment))
                self.retired.pop(id(environment), None)

    def reset(self, environments: list, rows: list[dict]) -> list:
        """reset(**row) of each row's environment (without the routing column); returns the observations."""
        observations = []
        for index, (env, row) in enumerate(zip(environments, rows)):
            try:
                observations.append(
                    env.reset(**{k: v for k, v in row.items() if not (self.routed and k == ENVIRONMENT_COLUMN)})
                )
            except Exception as error:
                prompt = str(row.get("prompt", ""))[:120]
                raise RuntimeError(
                    f"The environment {type(env).__name__}'s reset() raised {type(error).__name__}: "
                    f"{error} (row {index} of this generation's {len(rows)}, columns {sorted(row)}, "
                    f"prompt {prompt!r})."
                ) from error
        return observations

    def retire(self, environment) -> None:
        """Never hand `environment` out again (a call of its tools timed out and may still run), and score its
        rollout None. Instances that are not the pool's (e.g. a user's object) are left alone."""
        for pool in self.pool.values():
            for index, pooled in enumerate(pool):
                if pooled is environment:
                    del pool[index]
                    self.retired[id(environment)] = environment
                    self.lent.discard(id(environment))
                    return

    def scores(self, environment) -> bool:
        """Whether `environment`'s get_reward scores its rollout (False for a retired one, which is then let go)."""
        return self.retired.pop(id(environment), None) is None

    def reward_functions(self) -> list[Callable]:
        """One reward function per environment class with get_reward: it scores the rollouts of that exact class
        (None for the others), from the instance the rollout used."""
        functions = []
        for env_type in self.reward_types:
            if inspect.iscoroutinefunction(env_type.get_reward):

                async def reward(environments, _type=env_type, **kwargs):
                    return [await e.get_reward() if type(e) is _type and self.scores(e) else None for e in environments]
            else:

                def reward(environments, _type=env_type, **kwargs):
                    return [e.get_reward() if type(e) is _type and self.scores(e) else None for e in environments]

            reward.__name__ = env_type.__name__
            functions.append(reward)
        return functions


def placeholder_dataset(args, environment_factory):
    """TRL's train_dataset=None with an environment: the environment supplies the prompts through reset(); the
    loop runs on one generation's worth of empty-prompt rows, cycled, for max_steps."""
    from datasets import Dataset

    if isinstance(environment_factory, dict):
        raise ValueError(
            "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
            "`environment` column to route each example to its environment. Provide a dataset, or pass a "
            "single environment factory."
        )
    if args.max_steps <= 0:
        raise ValueError(
            "When training without a `train_dataset` (the environment owns the data and returns the "
            "prompt from `reset()`), `max_steps` must be set to a positive value to define the training "
            "length. Set it via `GRPOConfig(max_steps=...)`."
        )
    rows = max(args.generation_batch_size // args.num_generations, 1)
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})
