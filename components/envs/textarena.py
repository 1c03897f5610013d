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

        # a row that names its game (extra_info.env_seed: data.task=textarena's rows) replays that one, so a
        # held-out game is the same game at every evaluation; other rows get a game of the episode's seed
        game_seed = (row.get("extra_info") or {}).get("env_seed")
        self.env = textarena.make(env_id=self.game)
        self.env.reset(num_players=1, seed=int(game_seed) if game_seed is not None else seed)
        _, self.log = self.env.get_observation()
        return [{"role": "user", "content": self.log.strip()}]

    def step(self, text: str, last_turn: bool) -> Step:
        done, _ = self.env.step(action=text)
        if done or last_turn:
            rewards, _ = self.env.close()  # None for a game stopped before its end
            # a win is TextArena's reward 1; a lost game may still pay a share of it (GuessTheNumber pays how
            # close the guesses came: 0.58 for a game lost by repeating a guess), which is not a win
            won = float((rewards or {}).get(0, 0) >= 1)
            return Step(reward=won, done=True, counts={"game_won": won})
        _, log = self.env.get_observation()
        new, self.log = log[len(self.log) :], log  # the log holds the whole game; the turn adds its end
        said = [line for line in new.splitlines() if line.strip() and not line.startswith("[Player]")]
        return Step("\n".join(said), role="user")


@register("textarena", counters=("game_won",))
def textarena_env(settings, tools: dict):
    """A new game of multi_turn.game per episode, seeded by the row's extra_info.env_seed, else by the
    episode's group."""
    return lambda: TextArenaGame(settings.game)
