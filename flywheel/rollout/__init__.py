"""Rollouts: prompts for each environment, the agent loop, group scoring, task selection."""
