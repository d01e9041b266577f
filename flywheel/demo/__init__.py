"""The demo and its tooling: the whole loop on a fresh local stack (`flywheel demo`), its
progress watcher, the agent simulator and the sample trajectories."""
