"""A reward that varies with the response (`task.reward` of tests/test_replay_resume.py): the tiny model is not
warm-started there, so the countdown reward would be 0 everywhere and no step would change the weights."""


def score(prompt: str, response: str, label: object) -> float:
    return float(sum(map(ord, response)) % 7) / 6.0
