"""An example custom reward: `custom_reward_function.path=rewards/example.py`.

Keep your reward functions in this folder: `dvc repro` re-runs training and evaluation when a file here
changes (dvc.yaml lists `rewards` among their dependencies), and the resume fingerprint covers the file that
is configured, so an edited reward never "resumes" a run trained with the old one.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####\s*(-?\d+)")


def compute_score(response_text: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 for the right `#### N`, 0.1 for a wrong number after `####`, 0.0 without one.

    >>> compute_score("#### 46", "46"), compute_score("#### 45", "46"), compute_score("46", "46")
    (1.0, 0.1, 0.0)
    """
    found = _ANSWER.findall(response_text)
    if not found:
        return 0.0
    return 1.0 if found[-1] == ground_truth else 0.1
