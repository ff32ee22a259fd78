"""The commands: `hicache` (cli), `hicache-bench` (bench) and what only they use (reports,
plots, the soak, the policy reference)."""
