"""ppo: one-program SPMD PPO trainer for RLHF of causal language models."""
