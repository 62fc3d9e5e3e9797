"""graphamp inside the training frameworks people use: each submodule imports its framework lazily
(``graphamp.integrations.lightning``, ``.transformers``, ``.accelerate``, ``.fsdp``)."""
