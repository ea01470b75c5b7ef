"""Benchmarks: ``masks`` (grammar engines: compile, per-token masks, draft masks, our overhead) and the host
benchmarks (``mlx_host``, ``llama_cpp_host``, ``vllm_host``).  Each module has a ``main(argv) -> int``."""
