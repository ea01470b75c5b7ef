"""Upstream-ready diffs for hosts that have no hook of their own (``mlx_lm-server-plugin.diff``: ``mlx_lm.server
--plugin NAME``).  This folder ships in the wheel as the data package ``specgrammar_plugins.patches``;
``specgrammar_plugins.api.patch_path(name)`` finds a diff wherever the package is installed."""
