"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process."""


def register() -> None:
    """Registers what must be registered in every vLLM process (see the vLLM adapter)."""
