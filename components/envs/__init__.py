"""Environments: single- and multi-turn episodes the rollout plays (components/envs/base.py). Importing the
package registers the built-in ones in ENVS."""

from components.envs import agent, textarena, tools  # noqa: F401  (registers `agent`, `textarena`, `tools`)
