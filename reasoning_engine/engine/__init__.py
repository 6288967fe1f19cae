"""The serving engine: requests, paged KV cache, scheduler, model runner and the step loop."""
