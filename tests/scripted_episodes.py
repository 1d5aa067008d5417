"""A scripted ``Generator.play_episodes`` for tests of the episode runner: turns come from a
``generate_keys(prompts, keys, params) -> [Sample]`` function instead of a model."""

from __future__ import annotations

from models.qwen.sampler import TurnEnd


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
