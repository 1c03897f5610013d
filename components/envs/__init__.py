"""Environments: single- and multi-turn episodes the rollout plays (components/envs/base.py). Importing the
package registers the built-in ones in ENVS."""

from components.envs import agent, single, textarena, tools  # noqa: F401  (registers each by its name)
