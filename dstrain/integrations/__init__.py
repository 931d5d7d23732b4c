"""Integrations with other libraries' training stacks. `dstrain.integrations.transformers` (the Hugging
Face Trainer) imports transformers; nothing else here does."""
