"""RollVerify: verified partial rollout for RL of LLMs."""
