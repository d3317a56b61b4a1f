"""Guard inside other people's training loops: `lightning` and `hf` (each imports its framework
only when used)."""
