"""Multi-turn, token-in/token-out episodes (training/rollout/episodes.py, tool_calls.py,
tool_environment.py): the tool-call parser's typed results; an episode's ids are the prompt, the
sampled ids and the observation ids exactly (never decoded and encoded again), for ChatML with the
byte tokenizer and the Qwen tokenizer; the mask and what counts it; per-turn keys; tool results in
call order whatever order the episodes finish in; the environment's bad answers named or counted;
replay from a record without calling the environment; a nondeterministic tool named."""

from __future__ import annotations

import threading
import time

import pytest

from core.exceptions import DeterminismError
from data import calculator
from data.batch import DocSpan
from data.chat_template import ChatTemplate
from data.tokenizers import build_tokenizer
from models.generation.sampler import Sample, SamplingParams
from training.rollout.environment import EnvironmentFailure, NondeterministicToolError, Task, Transition
from training.rollout.episodes import EpisodeLimits, EpisodeRunner
from training.rollout.generator import Decoder
from training.rollout.rewards import resolve_reward
from training.rollout.tool_calls import MalformedCall, ToolCall, parse_tool_calls
from training.rollout.tool_environment import ToolEnvironment, resolve_environment
from tests.scripted_episodes import turn_by_turn

QWEN = "datasets/tokenizers/qwen"
"""The Qwen vocabulary ``make data`` builds; without it the ``qwen_vocabulary`` fixture (tests/conftest.py)
converts one."""
QWEN25_TEMPLATE, QWEN3_TEMPLATE = "tests/data/templates/qwen2_5_instruct.jinja", "tests/data/templates/qwen3.jinja"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>'


# ---------------------------------------------------------------------- parsing


def test_parser_reads_one_and_several_calls_in_order():
    two = CALL + '\n<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'
    assert parse_tool_calls("The answer is 4.", {"calculator"}) == []
    assert parse_tool_calls(CALL, {"calculator"}) == [ToolCall("calculator", {"expression": "4821 * 37"})]
    assert parse_tool_calls(two, {"calculator"}) == [ToolCall("calculator", {"expression": "4821 * 37"}),
                                                     ToolCall("calculator", {"expression": "2 + 2"})]


@pytest.mark.parametrize("text, reason", [
    ("<tool_call>{not json}</tool_call>", "not JSON"),
    ("<tool_call>[1, 2]</tool_call>", "JSON list, not an object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no string 'name'"),
    ('<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>', "'arguments' is a JSON str"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "is not closed"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "not JSON"),
])
def test_parser_types_each_malformed_call(text, reason):
    (call,) = parse_tool_calls(text, {"calculator"})
    assert isinstance(call, MalformedCall) and reason in call.reason


def test_an_unclosed_call_before_another_is_malformed_and_the_next_one_still_parses():
    text = '<tool_call>{"name": "calculator"' + CALL
    first, second = parse_tool_calls(text, {"calculator"})
    assert isinstance(first, MalformedCall) and second == ToolCall("calculator", {"expression": "4821 * 37"})


# ---------------------------------------------------------------------- a scripted sampler


class ScriptedGenerator:
    """A Generator whose turn ``t`` of every sample is ``script[t]`` (ids, or text encoded now), and
    which records the keys it was asked for and the ids it handed out."""

    seed = 5

    def __init__(self, tokenizer, script, *, stop_id=None):
        self.tokenizer, self.script, self.stop_id = tokenizer, script, stop_id
        self.keys, self.handed = [], {}

    def load(self, model):
        pass

    def generate_keys(self, prompts, keys, params):
        out = []
        for prompt, key in zip(prompts, keys):
            turn = 0 if key.purpose == "grpo" else int(key.purpose.rsplit("turn", 1)[1])
            ids = self.script[turn](key) if callable(self.script[turn]) else self.script[turn]
            ids = [int(t) for t in self.tokenizer.encode_array(ids)] if isinstance(ids, str) else list(ids)
            self.keys.append((key, len(prompt)))
            self.handed[(key.prompt_index, key.sample_index, turn)] = ids
            out.append(Sample(tokens=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out

    def play_episodes(self, prompts, key_of, params, on_turns, budgets):
        turn_by_turn(self.generate_keys)(prompts, key_of, params, on_turns, budgets)


class Model:
    training = True

    def eval(self):
        self.training = False

    def train(self, mode):
        self.training = mode


def _setup(tokenizer_name, script, *, environment=None, limits=None, template=None):
    tokenizer = build_tokenizer(tokenizer_name)
    template = ChatTemplate.for_tokenizer(tokenizer_name, template)
    rewards = [resolve_reward("exact_answer", weight=1.0)]
    environment = environment or ToolEnvironment({calculator.NAME: calculator.calculate}, [calculator.SPEC], rewards,
                                                 on_reward_error="error", max_calls_per_turn=2)
    generator = ScriptedGenerator(tokenizer, script)
    render = lambda messages: [int(t) for t in tokenizer.encode_array(  # noqa: E731
        template.observation_text(messages, tools=[calculator.SPEC]))]
    runner = EpisodeRunner(generator=generator, decoder=Decoder(tokenizer, template), environment=environment,
                           limits=limits or EpisodeLimits("calculator", max_turns=4, max_observation_tokens=128,
                                                          max_episode_tokens=400, timeout_s=5.0, on_error="error"),
                           render=render, context=2048)
    question = "What is 4821 * 37?"
    prompt_text = template.render([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tools=[calculator.SPEC])
    task = Task(3, [int(t) for t in tokenizer.encode_array(prompt_text)], prompt_text, "178377",
                DocSpan("tasks-agent", "train/part-000.jsonl", 0, 0, 1, 0))
    return tokenizer, template, generator, runner, task, question


def _play(runner, tasks, samples=1, **kwargs):
    return runner.play(Model(), tasks, [t.index for t in tasks], SamplingParams(max_new_tokens=200), purpose="grpo",
                       step=7, samples=samples, where=lambda task, s: f"step 7, prompt row {task.index}, sample {s}",
                       **kwargs)


@pytest.mark.parametrize("tokenizer_name, template_file, renders_alike", [
    ("byte", None, True), (QWEN, None, True), (QWEN, QWEN25_TEMPLATE, True), (QWEN, QWEN3_TEMPLATE, False)])
def test_episode_ids_are_the_sampled_and_observation_ids_and_match_the_rendered_conversation(
        tokenizer_name, template_file, renders_alike, qwen_vocabulary):
    tokenizer_name = str(qwen_vocabulary) if tokenizer_name == QWEN else tokenizer_name
    script = [CALL + "<|im_end|>", "178377<|im_end|>"]
    tokenizer, template, generator, runner, task, question = _setup(tokenizer_name, script, template=template_file)
    (episode,) = _play(runner, [task])
    observation = [int(t) for t in tokenizer.encode_array(
        template.observation_text([{"role": "tool", "content": "178377"}], tools=[calculator.SPEC]))]
    first, second = generator.handed[(3, 0, 0)], generator.handed[(3, 0, 1)]
    assert [t.sampled for t in episode.turns] == [tuple(first), tuple(second)]
    assert episode.tokens == first + observation + second
    assert episode.mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert episode.reward == 1.0 and [t.calls for t in episode.turns] == [("calculator",), ()]
    # The turn-2 prompt the sampler saw is the whole sequence so far.
    assert generator.keys[1][1] == len(task.prompt_ids) + len(first) + len(observation)
    # Sampled with the template's own tokenization, the episode is the conversation rendered at once;
    # but Qwen3's template writes an empty <think> block into the assistant turns after the last
    # user turn, ids the model never sampled: a trainer that rendered the conversation again would
    # train on them.
    whole = template.render([{"role": "user", "content": question}, {"role": "assistant", "content": CALL},
                             {"role": "tool", "content": "178377"}, {"role": "assistant", "content": "178377"}],
                            tools=[calculator.SPEC])
    ids = task.prompt_ids + episode.tokens
    rendered = [int(t) for t in tokenizer.encode_array(whole)]
    assert (rendered[:len(ids)] == ids) is renders_alike
    if not renders_alike:
        assert "<think>\n\n</think>" in whole and "<think>" not in tokenizer.decode(episode.tokens)


def test_sampled_ids_are_kept_even_where_encoding_their_text_gives_other_ids(qwen_vocabulary):
    qwen = str(qwen_vocabulary)
    tokenizer = build_tokenizer(qwen)
    canonical = [int(t) for t in tokenizer.encode_array(CALL)]
    spelled = [int(t) for ch in CALL for t in tokenizer.encode_array(ch)]  # one id per character: not how it encodes
    assert spelled != canonical and tokenizer.decode(spelled) == CALL
    end = [int(t) for t in tokenizer.encode_array("<|im_end|>")]
    _, _, _, runner, task, _ = _setup(qwen, [spelled + end, "178377<|im_end|>"])
    (episode,) = _play(runner, [task])
    assert episode.turns[0].sampled == tuple(spelled + end) and episode.turns[0].calls == ("calculator",)
    assert episode.tokens[:len(spelled) + len(end)] == spelled + end and episode.reward == 1.0


def test_a_qwen3_think_block_of_an_earlier_turn_stays_in_the_episode(qwen_vocabulary):
    """Qwen3's template drops the <think> block of an assistant turn before the last user turn
    when it renders a conversation at once; the episode keeps the ids the model sampled."""
    qwen = str(qwen_vocabulary)
    thinking = "<think>\nmultiply\n</think>\n\n" + CALL
    tokenizer, template, _, runner, task, question = _setup(qwen, [thinking + "<|im_end|>", "178377<|im_end|>"],
                                                            template=QWEN3_TEMPLATE)
    (episode,) = _play(runner, [task])
    sampled = [int(t) for t in tokenizer.encode_array(thinking + "<|im_end|>")]
    assert list(episode.turns[0].sampled) == sampled and episode.reward == 1.0
    assert "multiply" in tokenizer.decode(episode.tokens)


def test_each_turn_is_keyed_by_seed_step_row_sample_and_turn():
    _, _, generator, runner, task, _ = _setup("byte", [CALL + "<|im_end|>", "178377<|im_end|>"])
    _play(runner, [task], samples=2)
    assert [(k.seed, k.purpose, k.step, k.prompt_index, k.sample_index) for k, _ in generator.keys] == [
        (5, "grpo", 7, 3, 0), (5, "grpo", 7, 3, 1), (5, "grpo.turn1", 7, 3, 0), (5, "grpo.turn1", 7, 3, 1)]


def test_the_runner_reports_episodes_as_they_end():
    answer = "178377<|im_end|>"
    _, _, _, runner, task, _ = _setup("byte", [lambda key: CALL if key.sample_index == 0 else answer, answer])
    ended = []
    episodes = _play(runner, [task], samples=2, on_ended=ended.append)
    assert [len(e.turns) for e in episodes] == [2, 1]
    assert ended == [1, 1]  # sample 1 at its first turn, sample 0 at its second


def test_limits_end_episodes_turns_calls_and_observation_tokens():
    many = CALL * 3 + "<|im_end|>"
    limits = EpisodeLimits("calculator", max_turns=2, max_observation_tokens=300, max_episode_tokens=2000,
                           timeout_s=5.0, on_error="error")
    tokenizer, template, _, runner, task, _ = _setup("byte", [many, many], limits=limits)
    (episode,) = _play(runner, [task])
    # Three calls, two answered (max_calls_per_turn=2); the second turn is the last: scored, 0.
    text = tokenizer.decode(list(episode.turns[0].observation))
    assert text.count("178377") == 2 and "error: more than 2 tool calls in one turn" in text
    assert len(episode.turns) == 2 and episode.turns[1].outcome == "done" and episode.reward == 0.0
    small = EpisodeLimits("calculator", max_turns=4, max_observation_tokens=10, max_episode_tokens=2000,
                          timeout_s=5.0, on_error="error")
    _, _, _, runner, task, _ = _setup("byte", [many], limits=small)
    (episode,) = _play(runner, [task])
    assert episode.truncated and episode.turns[0].outcome == "limit" and episode.turns[0].observation == ()


def test_the_episode_budget_cuts_a_turn_and_ends_the_episode():
    limits = EpisodeLimits("calculator", max_turns=4, max_observation_tokens=128, max_episode_tokens=20,
                           timeout_s=5.0, on_error="error")
    _, _, _, runner, task, _ = _setup("byte", [CALL + "<|im_end|>"], limits=limits)
    (episode,) = _play(runner, [task])
    assert len(episode.tokens) == 20 and episode.mask == [1] * 20 and episode.truncated


class SlowFirstEnvironment:
    """Sample 0's answer comes last (it sleeps); each answers with its own sample index."""

    tools = []

    def reset(self, task, *, where):
        sample = int(where.rsplit("sample ", 1)[1])
        return _SleepyEpisode(sample)


class _SleepyEpisode:
    def __init__(self, sample):
        self.sample = sample

    def step(self, turn, *, last=False):
        if last:
            return Transition(reward=float(self.sample), done=True)
        time.sleep(0.3 if self.sample == 0 else 0.0)
        return Transition(reward=0.0, done=False, messages=({"role": "tool", "content": f"s{self.sample}"},))


def test_answers_apply_in_sample_order_whatever_order_they_finish_in():
    limits = EpisodeLimits("sleepy", max_turns=2, max_observation_tokens=128, max_episode_tokens=400,
                           timeout_s=5.0, on_error="error")
    tokenizer, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>", "b<|im_end|>"],
                                              environment=SlowFirstEnvironment(), limits=limits)
    episodes = _play(runner, [task], samples=3)
    assert [tokenizer.decode(list(e.turns[0].observation)).split("\n")[3][:2] for e in episodes] == ["s0", "s1", "s2"]
    assert [e.reward for e in episodes] == [0.0, 1.0, 2.0]


class BadEnvironment:
    tools = []

    def __init__(self, answer):
        self.answer = answer

    def reset(self, task, *, where):
        return self

    def step(self, turn, *, last=False):
        return self.answer()


def _raises():
    raise RuntimeError("tool crashed")


def _hangs():
    threading.Event().wait(2.0)
    return Transition(reward=0.0, done=True)


@pytest.mark.parametrize("answer, what", [(_raises, "raised RuntimeError: tool crashed"),
                                          (lambda: {"reward": 1.0}, "returned dict, not a Transition"),
                                          (lambda: Transition(reward=float("nan"), done=True), "not a finite number"),
                                          (_hangs, "took longer than tool_timeout_s=0.2 s")])
def test_a_bad_environment_is_named_with_step_row_sample_and_turn_or_counted_as_zero(answer, what):
    limits = EpisodeLimits("bad", max_turns=2, max_observation_tokens=128, max_episode_tokens=400, timeout_s=0.2,
                           on_error="error")
    _, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>"], environment=BadEnvironment(answer), limits=limits)
    with pytest.raises(EnvironmentFailure) as caught:
        _play(runner, [task])
    assert what in str(caught.value) and "'bad'" in str(caught.value)
    assert "step 7, prompt row 3, sample 0, turn 0" in str(caught.value)
    assert caught.value.exit_code == 3
    zero = EpisodeLimits("bad", max_turns=2, max_observation_tokens=128, max_episode_tokens=400, timeout_s=0.2,
                         on_error="zero")
    _, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>"], environment=BadEnvironment(answer), limits=zero)
    (episode,) = _play(runner, [task])
    assert episode.reward == 0.0 and episode.env_errors == 1
    assert episode.turns[0].outcome == ("timeout" if answer is _hangs else "error")
    assert episode.record()["env_errors"] == 1


# ---------------------------------------------------------------------- replay and resume


class CallsForbidden:
    tools = [calculator.SPEC]

    def reset(self, task, *, where):
        raise AssertionError("the environment was called during a replay")


def test_replay_appends_recorded_observations_without_calling_the_environment():
    script = [CALL + "<|im_end|>", "178377<|im_end|>"]
    _, _, _, runner, task, _ = _setup("byte", script)
    recorded = {(3, s): e.record() for s, e in enumerate(_play(runner, [task], samples=2))}
    originals = _play(runner, [task], samples=2)
    _, _, _, replaying, task, _ = _setup("byte", script, environment=CallsForbidden())
    replayed = _play(replaying, [task], samples=2, recorded=recorded, call_environment=False)
    assert [e.digest for e in replayed] == [e.digest for e in originals]
    assert [e.reward for e in replayed] == [1.0, 1.0]
    _, _, _, other, task, _ = _setup("byte", [CALL + "<|im_end|>", "999<|im_end|>"], environment=CallsForbidden())
    with pytest.raises(DeterminismError, match="turn 1 of step 7, prompt row 3, sample 0 sampled other ids"):
        _play(other, [task], samples=2, recorded=recorded, call_environment=False)


class CountingEnvironment:
    """A nondeterministic tool: its answer counts its calls."""

    tools = []

    def __init__(self):
        self.calls = 0

    def reset(self, task, *, where):
        return self

    def step(self, turn, *, last=False):
        self.calls += 1
        if last:
            return Transition(reward=0.0, done=True)
        return Transition(reward=0.0, done=False, messages=({"role": "tool", "content": str(self.calls)},),
                          calls=("counter",))


def test_a_resumed_step_whose_tool_answers_otherwise_names_the_tool_and_turn():
    limits = EpisodeLimits("counting", max_turns=2, max_observation_tokens=128, max_episode_tokens=400,
                           timeout_s=5.0, on_error="error")
    environment = CountingEnvironment()
    _, _, _, runner, task, _ = _setup("byte", ["a<|im_end|>", "b<|im_end|>"], environment=environment,
                                      limits=limits)
    recorded = {(3, 0): _play(runner, [task])[0].record()}
    with pytest.raises(NondeterministicToolError) as caught:
        _play(runner, [task], recorded=recorded)
    assert "'counter'" in str(caught.value) and "turn 0 of step 7, prompt row 3, sample 0" in str(caught.value)
    assert caught.value.exit_code == 5


def test_environments_resolve_by_name_or_class_path():
    rewards = [resolve_reward("exact_answer", weight=1.0)]
    built = resolve_environment("calculator", rewards=rewards, on_reward_error="error", max_calls_per_turn=1, key="k")
    assert built.tools == [calculator.SPEC]
    custom = resolve_environment("tests.training.test_agent_episodes:SlowFirstEnvironment", rewards=rewards,
                                 on_reward_error="error", max_calls_per_turn=1, key="k")
    assert isinstance(custom, SlowFirstEnvironment)
    from core.exceptions import ConfigError

    for name, message in (("search", "unknown environment"), ("no_such_pkg.mod:Env", "does not import"),
                          ("tests.training.test_agent_episodes:Nothing", "has no class")):
        with pytest.raises(ConfigError, match=message):
            resolve_environment(name, rewards=rewards, on_reward_error="error", max_calls_per_turn=1,
                                key="objective.grpo.environment.name")
