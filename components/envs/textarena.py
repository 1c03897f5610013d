"""TextArena's single-player games as environments (multi_turn.env=textarena, multi_turn.game: its env id,
GuessTheNumber-v0 by default). The game's opening is the first message; after each assistant turn the game's
new lines are the user's next message; a won game is reward 1, anything else (lost, or out of turns) 0.
TextArena's games run offline: nothing is downloaded."""

from __future__ import annotations

from components.envs.base import Step, register


class TextArenaGame:
    def __init__(self, game: str):
        self.game = game

    def reset(self, row: dict, seed: int) -> list[dict]:
        import textarena

        self.env = textarena.make(env_id=self.game)
        self.env.reset(num_players=1, seed=seed)
        _, self.log = self.env.get_observation()
        return [{"role": "user", "content": self.log.strip()}]

    def step(self, text: str, last_turn: bool) -> Step:
        done, _ = self.env.step(action=text)
        if done or last_turn:
            rewards, _ = self.env.close()  # None for a game stopped before its end
            won = float((rewards or {}).get(0, 0) > 0)
            return Step(reward=won, done=True, counts={"game_won": won})
        _, log = self.env.get_observation()
        new, self.log = log[len(self.log) :], log  # the log holds the whole game; the turn adds its end
        said = [line for line in new.splitlines() if line.strip() and not line.startswith("[Player]")]
        return Step("\n".join(said), role="user")


@register("textarena", counters=("game_won",))
def textarena_env(settings, tools: dict):
    """A new game of multi_turn.game per episode, seeded by the episode's group."""
    return lambda: TextArenaGame(settings.game)
