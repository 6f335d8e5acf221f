"""The devices executor: one XLA device per stage, heterogeneous stages included."""
