"""Upstream-ready diffs for hosts that have no hook of their own (``mlx_lm-server-plugin.diff``: ``mlx_lm.server
--plugin NAME``; ``vllm-custom-proposer-runner.diff``: vLLM hands its model runner to ``custom_class`` proposers,
which the vLLM adapter's general plugin also does in memory).  This folder ships in the wheel as the data package
``specgrammar_plugins.patches``; ``specgrammar_plugins.api.patch_path(name)`` finds a diff wherever the package is
installed."""
