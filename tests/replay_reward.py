"""A reward that varies with the response (`e2e_checks.REWARD`, the end-to-end tests' `task.reward`): their tiny
model is not warm-started, so the countdown reward would be 0 everywhere and no step would change the weights."""


def score(prompt: str, response: str, label: object) -> float:
    return float(sum(map(ord, response)) % 7) / 6.0
