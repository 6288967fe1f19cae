"""Building blocks of the models: each layer reads the step's ForwardBatch and never imports the engine."""
