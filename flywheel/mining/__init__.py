"""Failure mining: classify failed trajectories and turn them into verifiable tasks."""
