"""A scripted ``Generator.play_episodes`` for tests of the episode runner: turns come from a
``generate_keys(prompts, keys, params) -> [Sample]`` function instead of a model
(``turn_by_turn``), or from a script of texts by sample and purpose (``script_sampler``, for a
method's ``prepare``), and the scripted calculator call the agent tests of GRPO and PPO share
(``CALL``)."""

from __future__ import annotations

from models.generation.sampler import Sample, TurnEnd

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 3"}}\n</tool_call><|im_end|>'


def turn_by_turn(generate_keys):
    """``play_episodes`` over ``generate_keys``: turn t of every live episode in one call, then all of
    them to ``on_turns`` at once (as a sampler whose rows all end their turns at one refill point).
    Budgets are not applied here: the runner cuts a turn to its budget itself."""

    def play_episodes(prompts, key_of, params, on_turns, budgets):
        ids, turn = [list(p) for p in prompts], [0] * len(prompts)
        live = list(range(len(prompts)))
        while live:
            drawn = generate_keys([ids[e] for e in live], [key_of(e, turn[e]) for e in live], params)
            answers = on_turns([TurnEnd(e, turn[e], sample) for e, sample in zip(live, drawn)])
            going = []
            for episode, answer in zip(live, answers):
                if answer is not None:
                    ids[episode], turn[episode] = list(answer.ids), turn[episode] + 1
                    going.append(episode)
            live = going

    return play_episodes


def script_sampler(objective, script: dict[tuple[int, str], str]) -> dict[tuple[int, int, str], list[int]]:
    """Make ``objective``'s generator (GRPO's, PPO's) play turns from ``script`` instead of its model:
    the turn of sample ``s`` keyed ``purpose`` draws the ids of ``script[(s, purpose)]`` with
    log-probs ``-1 - 0.01 i``. Returns {(prompt row, sample, purpose): ids}, filled as turns are drawn."""
    tok = objective.tokenizer
    handed = {}

    def generate_keys(prompts, keys, params):
        out = []
        for key in keys:
            ids = [int(t) for t in tok.encode_array(script[(key.sample_index, key.purpose)])]
            handed[(key.prompt_index, key.sample_index, key.purpose)] = ids
            out.append(Sample(tokens=ids, logprobs=[-1.0 - 0.01 * i for i in range(len(ids))], finish_reason="stop"))
        return out

    objective.generator.load = lambda model: None
    objective.generator.play_episodes = turn_by_turn(generate_keys)
    return handed
