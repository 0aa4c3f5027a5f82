"""The worker actor: one process per tensor-parallel rank that runs the model runner."""
