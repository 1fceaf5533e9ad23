"""A verifiers v1 taskset and harness defined locally for grpokit's tests (tests/test_verifiers_v1.py), found by
verifiers as the plugin `verifiers_v1_lookup` (this module, on the tests' path): "key k3" asks for a value; the
reward is whether an answer holds it, plus a brevity term a tiny model can learn. The harness is a plain two-turn
chat loop with the OpenAI SDK, run in-process against the interception endpoint the env hands it."""

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

TABLE = {f"k{i}": f"v{i % 10}" for i in range(100)}
RETURNED = []  # every reward the task gave, in order: the test compares them with the logged rewards


class LookupData(vf.TaskData):
    key: str = ""


class LookupTask(vf.Task[LookupData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def answered(self, trace) -> float:
        text = "".join(str(m.content or "") for m in trace.messages if m.role == "assistant")
        reward = float(TABLE[self.data.key] in text) + 1.0 - min(len(text), 300) / 300
        RETURNED.append(reward)
        return reward


class LookupTaskset(vf.Taskset[LookupTask, vf.TasksetConfig]):
    def load(self):
        for key in ("k1", "k2", "k3", "k4"):
            yield LookupTask(LookupData(prompt=f"key {key}", key=key), self.config.task)


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime) -> None:
        pass

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=16)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": "again"},
        ]
        await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=16)
        return ProgramResult(0, "", "")


__all__ = ["ChatHarness", "LookupTaskset"]
