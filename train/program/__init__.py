"""What a run computes: the plan a config gets (planning: layout, parameter sharding, memory
policy, memory checks), the model it describes (model_setup), the train step (step; streamed:
with the optimizer state in host memory) and the state that puts them together (state)."""
