"""Model families; `registry.build_model` picks one from a checkpoint's model_type."""
